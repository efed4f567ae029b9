"""Chapter 06b in the tour: context parallelism on 4 ranks — causal ring attention, the same with zig-zag
load balancing, and DeepSpeed-Ulysses.

Each row trains the tiny GPT (2 layers, hidden 32, 4 heads, sequence 16, batch 4, Adam, 3 steps, float64)
with :func:`minipar.sequence.context_parallel.run` and compares the loss at every step and every parameter
with one device (harness float64 tolerance). Bytes: what one rank sends for one transformer layer, forward
and backward (b=4, s=16, h=32, float32): the communication log's model, what the sockets carried (observed),
and the method's formula. The observed bytes are the formula plus gloo's framing, 144 B per point-to-point
message on this transport (an all-to-all on 4 ranks is 3 messages); the note gives the count.
"""
from __future__ import annotations

import functools

import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.course.tour import WORLD_SIZE, TourRow
from minipar.launcher import launch
from minipar.models import GPTConfig
from minipar.sequence import context_parallel as cp
from minipar.sequence.measure import formula_bytes, layer_on_rank

B, S, H, A = 4, 16, 32, 4


def measure(method: str, world_size: int = WORLD_SIZE) -> dict:
    """Per-rank means of one layer's bytes (model, observed) and messages, with the formula."""
    per_rank = launch(layer_on_rank, world_size, method, B, S, GPTConfig(n_embd=H, n_head=A), quiet=True)
    mean = lambda key: sum(r[key] for r in per_rank) / len(per_rank)  # noqa: E731
    observed = None if any(r["bytes_observed"] is None for r in per_rank) else mean("bytes_observed")
    return {"model": mean("bytes_sent"), "observed": observed, "messages": mean("messages"),
            "formula": formula_bytes(method, B, S, H, world_size), "per_rank": per_rank}


def _run(method: str) -> TourRow:
    recipe = gpt_recipe(steps=3, batch_size=B, seq_len=S, n_embd=H, n_head=A)
    recipe.dtype = torch.float64
    comparison = compare(train_reference(recipe), cp.run(recipe, world_size=WORLD_SIZE, method=method, quiet=True),
                         dtype=torch.float64)
    m = measure(method)
    messages = m["messages"]
    if m["observed"] is None:
        wire = "observed: not available on this system (no /proc/self/io)"
    else:
        extra = m["observed"] - m["formula"]
        wire = (f"observed − formula = {extra:.0f} B over {messages:.0f} messages "
                f"({extra / messages:.0f} B each: gloo's framing)")
    return TourRow(strategy=f"cp-{method}" if method.startswith("ring") else method, world_size=WORLD_SIZE,
                   matches=comparison.matches, max_abs_diff=comparison.max_abs_diff,
                   bytes_sent_per_rank=m["model"], bytes_formula=m["formula"], peak_bytes_per_rank=None,
                   bytes_observed_per_rank=m["observed"], note=f"bytes per layer, forward + backward; {wire}")


STRATEGIES = [("cp-ring", functools.partial(_run, "ring")),
              ("cp-ring-zigzag", functools.partial(_run, "ring-zigzag")),
              ("ulysses", functools.partial(_run, "ulysses"))]

"""Chapter 13 in the tour: the invariant mode (:mod:`minipar.invariant_mode`) — dp 2 × tp 2 and dp 2 × pp 2 × tp 2
against one device, both in the mode, compared with ``torch.equal`` (kind ``"bitwise"``: no tolerance at all).

Each row trains the tiny GPT (2 layers, hidden 16, vocabulary 32, AdamW, 3 steps, float32, global batch
8 × 8 tokens, m = 2) with :func:`minipar.hybrid.runner.run` ``(invariant=True)``; ``max |Δ|`` is the largest
difference over the losses and every parameter (0 when the row matches). Bytes: the communication log's model
per rank per step, mean over the ranks, and what the sockets took (:mod:`minipar.wire`); no formula column:
the mode replaces each all-reduce by an all-gather plus the same tree on every rank, (n−1)·S per rank instead
of the ring's 2(n−1)/n·S — the note gives the default mode's bytes for the same layout beside it.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import torch

from minipar.course.tour import TourRow
from minipar.hybrid.runner import run
from minipar.recipe import gpt_recipe

LAYOUTS = {"invariant dp2×tp2": dict(dp=2, tp=2, micro_batches=2),
           "invariant dp2×pp2×tp2": dict(dp=2, pp=2, tp=2, micro_batches=2)}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def recipe():
    tiny = gpt_recipe(steps=3, batch_size=8, seq_len=8, n_layer=2, n_embd=16, vocab_size=32, block_size=8)
    return dataclasses.replace(tiny, optimizer=adamw)


def _losses_params(ranks):
    losses = next(r.losses for r in ranks if r.losses is not None)
    return torch.tensor(losses), {n: p for r in ranks for n, p in r.params.items()}


def _mean(ranks, measure) -> float:
    return sum(measure(r) for r in ranks) / len(ranks)


def _run(name: str) -> TourRow:
    start = time.perf_counter()
    ref_losses, ref_params = _losses_params(run(recipe(), invariant=True, micro_batches=1))
    ranks = run(recipe(), invariant=True, **LAYOUTS[name])
    default = run(recipe(), **LAYOUTS[name])
    losses, params = _losses_params(ranks)
    pairs = [(ref_losses, losses)] + [(ref_params[n], params[n]) for n in ref_params]
    matches = all(torch.equal(a, b) for a, b in pairs)
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in pairs)
    model = lambda rs: _mean(rs, lambda r: sum(r.bytes_by_kind.values()))          # noqa: E731
    note = (f"torch.equal on the 3 losses and all {len(ref_params)} parameters after 3 AdamW steps (float32); "
            f"model bytes per rank per step {model(ranks) / 1024:.1f} KiB in the mode, "
            f"{model(default) / 1024:.1f} KiB in the default mode (an all-gather per all-reduce, and one f per "
            f"fused QKV part)")
    return TourRow(strategy=name, world_size=len(ranks), matches=matches, max_abs_diff=diff,
                   bytes_sent_per_rank=model(ranks), bytes_formula=None, peak_bytes_per_rank=None, note=note,
                   seconds=time.perf_counter() - start, kind="bitwise",
                   bytes_observed_per_rank=_mean(ranks, lambda r: r.observed.get("dp", 0) + r.observed.get("pp+tp", 0)))


STRATEGIES = [(name, functools.partial(_run, name)) for name in LAYOUTS]

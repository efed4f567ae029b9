"""Chapters 05 and 06 in the tour: Megatron tensor parallelism, and with sequence parallelism, on 4 ranks.

Each row trains the tiny GPT (2 layers, hidden 32, 4 heads, vocabulary 66 padded to 68, label smoothing
0.1, Adam, 3 steps, float64) with :func:`minipar.tensor.gpt.compare_to_one_device` and compares loss and
every parameter with one device (harness float64 tolerance). Bytes: what one rank sends for one transformer
layer in one forward and backward (b=4, s=16, h=32, float32, from the communication log), next to the
formula: 4 all-reduces of b·s·h for TP; for TP+SP the same volume as all-gathers + reduce-scatters plus
the two re-gathers in backward. The note gives the measured activation bytes of that layer next to
Korthikanti et al.'s count scaled to float32 (+ LayerNorm statistics and the causal mask it leaves out).
"""
from __future__ import annotations

import functools

import torch

from minipar.check import gpt_recipe
from minipar.launcher import launch
from minipar.models import GPTConfig
from minipar.tensor.gpt import compare_to_one_device, measure_layer
from minipar.tensor.sequence import activation_bytes_formula, sp_bytes_per_layer, tp_bytes_per_layer, uncounted_bytes
from minipar.course.tour import WORLD_SIZE, TourRow

B, S, H, A = 4, 16, 32, 4


def _run(sequence_parallel: bool) -> TourRow:
    recipe = gpt_recipe(steps=3, batch_size=B, seq_len=S, vocab_size=66, n_embd=H, n_head=A)
    recipe.dtype = torch.float64
    comparison = compare_to_one_device(recipe, world_size=WORLD_SIZE, sequence_parallel=sequence_parallel,
                                       label_smoothing=0.1, launch_kwargs={"quiet": True})
    per_rank = launch(measure_layer, WORLD_SIZE, GPTConfig(n_embd=H, n_head=A), B, S, sequence_parallel,
                      quiet=True)
    sent = sum(r["bytes_sent"] for r in per_rank) / len(per_rank)
    formula = (sp_bytes_per_layer if sequence_parallel else tp_bytes_per_layer)(S, B, H, WORLD_SIZE)
    act = max(r["activation_bytes"] for r in per_rank)
    act_formula = activation_bytes_formula(S, B, H, A, WORLD_SIZE, sequence_parallel, value_bytes=4, dropout=False)
    act_formula += uncounted_bytes(S, B, WORLD_SIZE, sequence_parallel)
    name = "tensor parallel + sequence parallel" if sequence_parallel else "tensor parallel (Megatron)"
    return TourRow(strategy=f"{name}, tp={WORLD_SIZE}", world_size=WORLD_SIZE, matches=comparison.matches,
                   max_abs_diff=comparison.max_abs_diff, bytes_sent_per_rank=sent, bytes_formula=formula,
                   peak_bytes_per_rank=None,
                   note=f"bytes per layer per step; activations per layer {act} B (formula {act_formula:.0f} B)")


STRATEGIES = [("tensor parallel", functools.partial(_run, False)),
              ("tensor parallel + sequence parallel", functools.partial(_run, True))]

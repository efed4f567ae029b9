"""Chapter 04 in the tour: pipeline schedules on 4 ranks.

Each row trains the tiny GPT (8 layers, hidden 16, 2 heads, sequence 8, global batch 16 cut into m = 8
micro-batches of 2, Adam, 2 steps, float64) with :func:`minipar.pipeline.runtime.parallel_train` and
compares the loss at every step and every parameter with one device (harness float64 tolerance: the
micro-batch gradients are summed in another order, which Adam in float32 can amplify for weights whose
gradient is nearly zero). Bytes: what one rank sends per step (mean over ranks,
from the communication log) next to the formula 2 · (p·v - 1) · m · A / p, A = one micro-batch's
activation (2 · 8 · 16 · 8 B): every stage boundary carries each micro-batch's activation forward and its
gradient back. Peak: live bytes created during a step (activations, gradients, buffers), max over ranks,
measured with :class:`minipar.memory.LiveTensorTracker`. The PipeDream rows are compared with their own
update rules (they are not synchronous training) and train with SGD for 6 steps.
"""
from __future__ import annotations

import functools

import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.pipeline import pipedream, runtime
from minipar.pipeline.pipedream import reference_2bw, reference_async
from minipar.pipeline.simulate import simulate
from minipar.pipeline.schedules import make_schedule
from minipar.course.tour import WORLD_SIZE, TourRow

M, BATCH, SEQ, HIDDEN = 8, 16, 8, 16
ACT_BYTES = (BATCH // M) * SEQ * HIDDEN * 8             # float64


def _recipe(optimizer="adam", steps=2):
    recipe = gpt_recipe(steps=steps, batch_size=BATCH, seq_len=SEQ, n_layer=8, n_embd=HIDDEN, n_head=2,
                        optimizer=optimizer)
    recipe.dtype = torch.float64
    return recipe


def _bytes_formula(p, m, v):
    return 2 * (p * v - 1) * m * ACT_BYTES / p


def _schedule_row(schedule: str, v: int = 1, recompute: bool = False) -> TourRow:
    recipe = _recipe()
    runs = runtime.run(recipe, world_size=WORLD_SIZE, schedule=schedule, m=M, v=v, recompute=recompute,
                       track_memory=True)
    cmp = compare(train_reference(recipe), runs, dtype=recipe.dtype)
    sent = sum(r.bytes_sent for r in runs) / len(runs) / recipe.steps
    peak = max(b for r in runs for _, _, b in r.memory)
    bubble = simulate(make_schedule(schedule, WORLD_SIZE, M, v)).bubble_fraction
    name = {"1f1b": "1F1B (PipeDream-Flush)", "gpipe": "GPipe", "interleaved": f"interleaved 1F1B, v={v}",
            "zb-h1": "zero bubble ZB-H1", "naive": "naive model parallel"}[schedule]
    return TourRow(strategy=f"pipeline {name}{' + recompute' if recompute else ''}, pp={WORLD_SIZE}, m={M}",
                   world_size=WORLD_SIZE, matches=cmp.matches, max_abs_diff=cmp.max_abs_diff,
                   bytes_sent_per_rank=sent, bytes_formula=_bytes_formula(WORLD_SIZE, M, v),
                   peak_bytes_per_rank=peak, note=f"bytes per step; simulated bubble {bubble:.3f}")


def _pipedream_row(mode: str) -> TourRow:
    recipe = _recipe("sgd", steps=6)
    runs = pipedream.run(recipe, world_size=WORLD_SIZE, mode=mode, m=M, lr=0.1)
    rule = reference_2bw(recipe, 0.1) if mode == "2bw" else reference_async(recipe, WORLD_SIZE, 0.1)
    cmp = compare(rule, runs, dtype=recipe.dtype)
    name = "PipeDream-2BW" if mode == "2bw" else "PipeDream async + weight stashing"
    versions = [r.most_versions for r in runs]
    return TourRow(strategy=f"pipeline {name}, pp={WORLD_SIZE}", world_size=WORLD_SIZE, matches=cmp.matches,
                   max_abs_diff=cmp.max_abs_diff, bytes_sent_per_rank=None, bytes_formula=None,
                   peak_bytes_per_rank=None,
                   note=f"compared with its update rule, not with synchronous training; weight versions "
                        f"held per rank {versions}")


STRATEGIES = [
    ("pipeline GPipe", functools.partial(_schedule_row, "gpipe")),
    ("pipeline GPipe + recompute", functools.partial(_schedule_row, "gpipe", recompute=True)),
    ("pipeline 1F1B", functools.partial(_schedule_row, "1f1b")),
    ("pipeline interleaved 1F1B", functools.partial(_schedule_row, "interleaved", 2)),
    ("pipeline zero bubble ZB-H1", functools.partial(_schedule_row, "zb-h1")),
    ("pipeline PipeDream-2BW", functools.partial(_pipedream_row, "2bw")),
    ("pipeline PipeDream async", functools.partial(_pipedream_row, "async")),
]

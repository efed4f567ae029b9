"""The tiny GPT that chapters 08 and 09b train on a mesh, and one layout measured on its ranks.

* :func:`recipe` — tiny GPT (4 layers, hidden 32, 4 heads), Adam, global batch 16 × 8 tokens, float64.
* :func:`measure_layout` — a layout (8 ranks; 16 with cp = 2) against one device, with its bytes per rank per
  step by kind beside :func:`minipar.hybrid.parallel3d.bytes_formula`, observed bytes, memory, step time and
  one pipeline's bubble. The tour rows of both chapters are made from it.
"""
from __future__ import annotations

import statistics

import torch

from minipar import comm
from minipar.check import RunResult, compare, gpt_recipe, train_reference
from minipar.hybrid.parallel3d import bytes_formula, validate
from minipar.hybrid.runner import parallel_train
from minipar.launcher import launch
from minipar.layout import Layout
from minipar.pipeline.schedules import bubble_formula
from minipar.pipeline.timeline import measured_idle_fraction

__all__ = ["BATCH", "SEQ", "recipe", "measure_layout"]

BATCH, SEQ = 16, 8


def recipe(steps: int = 3):
    """The chapter's recipe: tiny GPT (4 layers, hidden 32, 4 heads), Adam, global batch 16 × 8 tokens, float64."""
    r = gpt_recipe(steps=steps, batch_size=BATCH, seq_len=SEQ, n_layer=4)
    r.dtype = torch.float64
    return r


def _logged_rank(rank, world_size, recipe, layout):
    """:func:`parallel_train`, with every call of its steps also kept: (its HybridRun, {dims spanned: observed
    bytes per step, or None where a call is asynchronous — isend/irecv's bytes leave after they return})."""
    with comm.recording() as log:                      # no mesh here: only the step's own logs name dims
        result = parallel_train(rank, world_size, recipe, layout=layout, track_memory=True)
    observed: dict = {}
    for rec in log.records:
        if rec.dims is not None:                       # a step's call (not the clock's broadcast, the gather)
            seen = observed.get(rec.dims, 0)
            observed[rec.dims] = None if seen is None or rec.observed_sent is None else seen + rec.observed_sent
    steps = len(recipe.batches)
    return result, {dims: None if b is None else b / steps for dims, b in observed.items()}


def measure_layout(layout: dict, steps: int = 3, m: int = 4, reference: RunResult | None = None) -> dict:
    """Run ``layout`` on its ranks (8; 16 with cp = 2); return its comparison with one device and its
    measurements (mean over ranks of bytes per step by kind, formula beside; observed per window and per
    dims spanned where the calls block; max peak and model states; median step time; one pipeline's bubble)."""
    r, shape = recipe(steps), Layout(**layout, micro_batches=m)
    validate(r, layout=shape)
    logged = launch(_logged_rank, shape.world_size, r, shape, quiet=True, timeout=120.0)
    runs = [x for x, _ in logged]
    c = compare(reference or train_reference(r), runs, dtype=r.dtype)
    cfg = r.model().cfg
    formulas = [bytes_formula(cfg, batch=BATCH, seq=SEQ, layout=shape, pp_rank=x.coords["pp"]) for x in runs]
    mean = lambda xs: sum(xs) / len(xs)                                          # noqa: E731
    one_pipeline = [x for x in runs if all(c == 0 for d, c in x.coords.items() if d != "pp")]   # dp = tp = 0
    sched, p, v = layout.get("schedule", "1f1b"), layout["pp"], layout.get("v", 1)
    kinds = list(formulas[0])                                                    # dp, pp, tp (+ cp)
    return {
        "matches": c.matches, "max_abs_diff": c.max_abs_diff,
        "bytes": {k: mean([x.bytes_by_kind[k] for x in runs]) for k in kinds},
        "formula": {k: mean([f[k] for f in formulas]) for k in kinds},
        "observed": {k: mean([x.observed[k] for x in runs]) for k in ("dp", "pp+tp")},
        "observed_by_dims": {d: None if None in (o.get(d) for _, o in logged) else mean([o[d] for _, o in logged])
                             for d in logged[0][1]},
        "calls": {k: mean([x.calls_by_kind[k] for x in runs]) for k in kinds},
        "peak_bytes": max(x.peak_bytes for x in runs),
        "model_state_bytes": max(x.model_state_bytes for x in runs),
        "step_seconds": statistics.median(s for x in runs for s in x.step_seconds[1:]),
        "bubble": measured_idle_fraction(one_pipeline) if p > 1 else 0.0,
        "bubble_formula": bubble_formula(sched, p, m, v) if p > 1 else 0.0,
        "runs": runs,
    }

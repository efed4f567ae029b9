"""Chapter 08 in the tour: 3D parallelism on 8 ranks (dp 2 × pp 2 × tp 2, 1F1B, m = 4), with plain data
parallelism, with ZeRO-1 over the dp group, and with ZeRO-3 gathered and reduced once per step. (The 5D rows
are chapter 09b's.)

Each row trains the tiny GPT (4 layers, hidden 32, 4 heads, Adam, 3 steps, float64, global batch 16 × 8
tokens) with :func:`minipar.hybrid.runner.run` and compares the loss at every step and every parameter
with one device (harness float64 tolerance). Bytes: sent per rank per step, mean over the 8 ranks, from the
communication log (DP + PP + TP), next to :func:`minipar.hybrid.parallel3d.bytes_formula`; observed: what
the sockets took (:mod:`minipar.wire`). The note splits them by kind and says why observed differs.
"""
from __future__ import annotations

import functools

from minipar.course.tour import TourRow

from .measure import LAYOUTS, measure_layout

WORLD = 8


def _kib(x):
    return f"{x / 1024:.1f} KiB"


ROW_LAYOUTS = {"3d": LAYOUTS["2x2x2"], "3d+zero1": LAYOUTS["2x2x2+zero1"],
               # ZeRO-3 inside the 2-stage pipeline, gathered and reduced once per step
               "3d+zero3": dict(dp=2, pp=2, tp=2, zero=3)}


def _run(name: str) -> TourRow:
    layout = ROW_LAYOUTS[name]
    r = measure_layout(layout)
    b, f, o = r["bytes"], r["formula"], r["observed"]
    why = ("observed > model: gloo frames each write with a 48-byte header and the TP vocabulary loss sends tiny "
           "messages" if not layout.get("zero") else
           "observed DP ≈ 1.5× model: gloo's reduce_scatter all-reduces internally (2× the ring), the "
           "all-gather is 1×")
    if layout.get("zero") == 3:
        why += ("; ZeRO-3 in the pipeline: parameters gathered once at the step's start and kept over the m "
                "micro-batches, gradients reduce-scattered once after the last: ZeRO-1's bytes, shards between steps")
    note = (f"per step, model (formula): DP {_kib(b['dp'])} ({_kib(f['dp'])}), PP {_kib(b['pp'])} "
            f"({_kib(f['pp'])}), TP {_kib(b['tp'])} ({_kib(f['tp'])}); observed DP {_kib(o['dp'])}, "
            f"PP+TP {_kib(o['pp+tp'])}; {why}; bubble {r['bubble']:.2f} measured, {r['bubble_formula']:.2f} "
            f"formula")
    return TourRow(strategy=name, world_size=WORLD, matches=r["matches"],
                   max_abs_diff=r["max_abs_diff"], bytes_sent_per_rank=sum(b.values()),
                   bytes_formula=sum(f.values()), peak_bytes_per_rank=r["peak_bytes"], note=note,
                   bytes_observed_per_rank=o["dp"] + o["pp+tp"])


STRATEGIES = [("3d", functools.partial(_run, "3d")), ("3d+zero1", functools.partial(_run, "3d+zero1")),
              ("3d+zero3", functools.partial(_run, "3d+zero3"))]

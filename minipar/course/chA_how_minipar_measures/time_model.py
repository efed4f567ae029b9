"""Appendix A's model of time, shown: rankings that count only what lies
outside the run-to-run spread, and a run of this course traced and played on a DGX A100 node.

* :func:`bound_split` — where a list of operators' seconds on a card goes (:func:`minipar.machine.device.op_seconds`
  split in three): compute-bound (FLOPs / (peak·η) is the larger term), memory-bound (bytes / HBM is) and the
  launch floor (kernels × floor). The three add up to :func:`minipar.machine.device.ops_seconds`.
* :func:`apart`, :func:`ranking_outside_spread` — two strategies are *apart* when their ranges over the runs
  [min, max] do not overlap; otherwise they are tied (a model's single number — a replay on a card, the planner —
  counts as ±½ % around it: :data:`MODEL_TIE`). A ranking check counts only pairs apart on both sides:
  Goodman and Kruskal's γ = (C − D) / (C + D) (1954, "Measures of association for cross classifications", JASA
  49), C the pairs in the same order, D those swapped, ties (either side) left out.
* :func:`traced_on_a100` — one strategy of the step model traced with its operators counted
  (:func:`minipar.observe.measure.measure_steps` with ``ops=True``: a separate run from any timed one, since
  counting slows every operator) and replayed on :func:`minipar.machine.cluster.a100_cluster`; and
  :func:`planner_kernels` — the same split for a layout the planner costs at real size
  (:mod:`minipar.plan.operators`).
"""
from __future__ import annotations

import math

from minipar.machine.cluster import a100_cluster
from minipar.machine.device import DeviceCard, Op, op_seconds
from minipar.machine.intervals import step_slice
from minipar.observe.measure import measure_steps
from minipar.observe.opcount import ops_of
from minipar.machine.replay import replay
from minipar.machine.trace import Compute
from minipar.plan.operators import MEGATRON_2022, head_step, layer_step

from .calibration import STEP_RANKS, step_recipe, train

__all__ = ["bound_split", "MODEL_TIE", "apart", "ranking_outside_spread", "tied_first", "traced_on_a100",
           "planner_kernels"]


def bound_split(ops, card: DeviceCard) -> dict:
    """{"compute-bound", "memory-bound", "floor": seconds, "kernels": count} of ``ops`` (:class:`Op` list) on
    ``card``: each operator's max(F/(peak·η_F), B/(HBM·η_B)) goes to the larger side, its kernels × launch
    floor to "floor"."""
    out = {"compute-bound": 0.0, "memory-bound": 0.0, "floor": 0.0, "kernels": 0}
    for op in ops:
        floor = op.count * op.kernels * card.launch_floor
        roof = op_seconds(op, card) - floor
        eta = {"gemm": card.gemm_efficiency, "attention": card.attention_efficiency}.get(op.kind, 1.0)
        compute = op.flops / (card.peak_flops * eta) if op.flops else 0.0
        memory = op.bytes / (card.hbm_bandwidth * card.memory_efficiency)
        out["compute-bound" if compute > memory else "memory-bound"] += roof
        out["floor"] += floor
        out["kernels"] += op.count * op.kernels
    return out


def apart(a: dict, b: dict) -> bool:
    """True when two spreads ({"min", "max", ...} over runs) do not overlap: their order is outside the spread."""
    return a["max"] < b["min"] or b["max"] < a["min"]


MODEL_TIE = 0.01      # a model's numbers within 1 % of each other are ties: below what its inputs resolve


def _spread(v) -> dict:
    """A spread as it is; a model's single number as ±MODEL_TIE/2 around it."""
    half = MODEL_TIE / 2
    return v if isinstance(v, dict) else {"median": v, "min": v * (1 - half), "max": v * (1 + half)}


def ranking_outside_spread(predicted: dict, observed: dict) -> dict:
    """Compare two columns {name: spread or one number} (smaller is faster), counting only the pairs apart on
    both sides (:func:`apart`). Returns {"concordant", "discordant", "tied": [(a, b), ...] (overlapping on
    either side), "pairs", "gamma": (C − D)/(C + D), nan when no pair is apart, "swapped": [(a, b), ...]}."""
    if set(predicted) != set(observed):
        raise ValueError(f"the same strategies are needed on both sides, got {sorted(predicted)} and {sorted(observed)}")
    names = sorted(observed)
    c = d = 0
    tied, swapped = [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa, pb, oa, ob = (_spread(x) for x in (predicted[a], predicted[b], observed[a], observed[b]))
            if not (apart(pa, pb) and apart(oa, ob)):
                tied.append((a, b))
            elif (pa["median"] < pb["median"]) == (oa["median"] < ob["median"]):
                c += 1
            else:
                d += 1
                swapped.append((a, b))
    pairs = len(names) * (len(names) - 1) // 2
    return {"concordant": c, "discordant": d, "tied": tied, "pairs": pairs, "swapped": swapped,
            "gamma": (c - d) / (c + d) if c + d else math.nan}


def tied_first(column: dict) -> list:
    """The names tied for fastest in ``column`` {name: spread}: the fastest by median and every one whose range
    overlaps it, fastest first."""
    order = sorted(column, key=lambda k: _spread(column[k])["median"])
    best = _spread(column[order[0]])
    return [k for k in order if k == order[0] or not apart(best, _spread(column[k]))]


def _trained(rank, world_size, recipe, name):
    train(rank, world_size, name, recipe)


def traced_on_a100(name: str = "DDP", steps: int = 3, n: int = STEP_RANKS, nodes: int = 1) -> dict:
    """Train the step model with ``name`` on n ranks, operators counted (not timed), and replay its trace on
    ``a100_cluster(nodes)``. For the last step: {"step": its model seconds (slowest rank), "kernels": kernels
    the busiest rank launched in it, "floor": kernels × the card's launch floor, "split": :func:`bound_split` of
    that rank's operators, "rank", "card", "trace"}."""
    steps_run = measure_steps(_trained, n, step_recipe(steps), name, ops=True)
    cluster = a100_cluster(nodes)
    played = replay(steps_run.trace, cluster)
    step = played.step_gaps("step")[-1]
    per_rank = []
    for r in steps_run.trace.ranks:
        rows = [row for e in step_slice(r.events, "step", -1) if isinstance(e, Compute) for row in e.ops]
        per_rank.append((sum(row["count"] for row in rows), r.rank, rows))
    kernels, rank, rows = max(per_rank, key=lambda x: x[0])
    return {"step": step, "kernels": kernels, "floor": kernels * cluster.device.launch_floor, "rank": rank,
            "split": bound_split(ops_of(rows), cluster.device), "card": cluster.device, "trace": steps_run.trace}


def planner_kernels(model, layout, card: DeviceCard, kernels=MEGATRON_2022) -> dict:
    """:func:`bound_split` of one step of the first pipeline stage of ``layout`` at real size (its layers ×
    micro-batches, the head when there is one stage), from :mod:`minipar.plan.operators`."""
    m = max(1, layout.micro_batches)
    layer = layer_step(model, layout.micro_batch, layout.tp, layout.sp, layout.recompute, kernels)
    ops = [Op(o.name, o.kind, o.flops, o.bytes, o.kernels, o.count * m * (model.layers // layout.pp)) for o in layer]
    if layout.pp == 1:
        ops += [Op(o.name, o.kind, o.flops, o.bytes, o.kernels, o.count * m)
                for o in head_step(model, layout.micro_batch, layout.tp, kernels)]
    return bound_split(ops, card)


def draw_gpu_check(rows: list, ax=None):
    """The steps one H100 measured (:func:`minipar.machine.gpu_measured.step_rows`): per step, the device's own
    time (the card's price of its counted operators), the eager bounds as a band, and what was measured (dots:
    each run), milliseconds on a log scale."""
    import matplotlib.pyplot as plt
    ax = ax or plt.gca()
    steps = list(dict.fromkeys(r["step"] for r in rows))
    for y, step in enumerate(steps):
        mine = [r for r in rows if r["step"] == step]
        first = mine[0]
        ax.barh(y, first["high"] * 1e3 - first["low"] * 1e3, left=first["low"] * 1e3, height=0.5, color="0.85",
                label="eager bounds (model)" if y == 0 else None)
        ax.plot([first["device"] * 1e3], [y], "|", color="C0", markersize=18, mew=2,
                label="device alone (model)" if y == 0 else None)
        ax.plot([r["measured"] * 1e3 for r in mine], [y] * len(mine), "o", color="C3",
                label="measured (each run)" if y == 0 else None)
    ax.set_yticks(range(len(steps)), steps)
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds per step (log)")
    ax.set_title("One H100: measured steps against the device model")
    ax.legend(loc="upper left", fontsize=8)
    return ax

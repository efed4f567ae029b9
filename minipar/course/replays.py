"""A measured run replayed on named clusters, and one step of a replay read: shared by chapters 02 and 03.

A chapter's timing module measures its strategy (:mod:`minipar.observe.measure`: the traces, a step's FLOPs
and CPU seconds); :func:`replays` plays every trace on each cluster (:func:`minipar.machine.replay.replay`),
"here" with compute as measured, any other cluster with compute scaled to its device's FLOP/s, optionally
as a what-if (a larger model: :func:`scaled`). One step of a replay (:func:`last_step`) is then read for its
exposed communication and the share of it hidden under compute, and drawn (:func:`draw_replays`).

The replays are a model (FlexFlow's simulator, Jia et al. 2019): labelled so wherever they are shown.
"""
from __future__ import annotations

import dataclasses

from minipar.machine.replay import ReplayResult, device_scale, replay
from minipar.machine.trace import Comm, Compute, RankTrace, Trace
from minipar.pipeline.gantt import draw_gantt, replay_rows

__all__ = ["GPT2_SMALL_PARAMS", "SEED_TOKENS_PER_GPU", "scaled", "replays", "last_step", "exposed_per_step",
           "hidden_share", "draw_replays"]

GPT2_SMALL_PARAMS = 124_439_808     # the Hugging Face guide's model (GPT-2 small)
SEED_TOKENS_PER_GPU = 4 * 1024      # the Hugging Face guide: --per_device_train_batch_size 4, run_clm's 1024-token blocks


def scaled(trace, bytes_factor: float, ops_factor: float = 1.0, op_bytes_factor: float | None = None):
    """The same program with every message ``bytes_factor`` times larger (a what-if: a model with that many
    times the parameters, in the same number of buckets) and, where its compute segments carry operators
    (``ops=True``), each operator's FLOPs ``ops_factor`` times larger and its bytes ``op_bytes_factor`` times
    (default ``ops_factor``) — the same kernels, each on bigger tensors (their number, and so their launch
    floors, unchanged)."""
    op_bytes_factor = ops_factor if op_bytes_factor is None else op_bytes_factor
    grown: dict = {}                                  # id(rows) -> the scaled rows (segments may share them)

    def grow(e):
        if isinstance(e, Comm):
            return dataclasses.replace(e, bytes=round(e.bytes * bytes_factor))
        if isinstance(e, Compute) and e.ops is not None and (ops_factor, op_bytes_factor) != (1, 1):
            if id(e.ops) not in grown:
                grown[id(e.ops)] = [dict(r, flops=r["flops"] * ops_factor, bytes=r["bytes"] * op_bytes_factor)
                                    for r in e.ops]
            return dataclasses.replace(e, ops=grown[id(e.ops)])
        return e
    ranks = [RankTrace(r.rank, [grow(e) for e in r.events]) for r in trace.ranks]
    return Trace(ranks, dict(trace.meta, bytes_factor=bytes_factor, ops_factor=ops_factor))


def replays(measured: dict, clusters: dict, compute_factor: float = 1.0, bytes_factor: float = 1.0,
            op_bytes_factor: float | None = None) -> dict:
    """{cluster name: {config: ReplayResult}} of ``measured["traces"]`` ({config: Trace}). A cluster named
    "here" replays compute as measured (scale 1); a cluster with a device card (``cluster.device``) replays
    ``measured["counted"]`` (the same programs traced with ``ops=True``), each operator priced on the card;
    any other cluster scales the measured compute by ``measured["flops_here"]`` / the device's FLOP/s.
    What-ifs (1: the measured run): ``compute_factor`` multiplies every compute segment (on a card: every
    operator's FLOPs and bytes, not its kernels), ``bytes_factor`` every message (:func:`scaled`) — a model
    ``f`` times larger trained on ``k`` times the tokens per rank is compute × f·k, bytes × f; on a card
    ``op_bytes_factor`` (default ``compute_factor``) multiplies the operators' bytes instead — activations grow
    with tokens × width, k·w, not with f·k."""
    out = {}
    for where, cluster in clusters.items():
        if cluster.device is not None:
            if "counted" not in measured:
                raise ValueError(f"{where!r} has a device card: it replays measured['counted'], traces with ops=True")
            out[where] = {n: replay(scaled(t, bytes_factor, compute_factor, op_bytes_factor), cluster)
                          for n, t in measured["counted"].items()}
            continue
        scale = 1.0 if where == "here" else device_scale(cluster, measured["flops_here"])
        out[where] = {n: replay(scaled(t, bytes_factor) if bytes_factor != 1 else t, cluster,
                                compute_scale=scale * compute_factor) for n, t in measured["traces"].items()}
    return out


def last_step(result, label: str = "step"):
    """``result`` cut to one step: each rank's spans clipped to the gap between its last two marks ``label``
    (so neither a first step that differs from the rest nor the set-up or a final gather is counted)."""
    timelines, finish = [], []
    for spans, marks in zip(result.timelines, result.marks):
        times = [t for name, t in marks if name == label]
        if len(times) < 2:
            raise ValueError(f"fewer than two marks {label!r} on a rank")
        t0, t1 = times[-2], times[-1]
        timelines.append([dataclasses.replace(s, start=max(s.start, t0) - t0, end=min(s.end, t1) - t0)
                          for s in spans if s.end > t0 and s.start < t1])
        finish.append(t1 - t0)
    return ReplayResult(timelines, finish, result.cluster)


def exposed_per_step(result, label: str = "step") -> float:
    """Communication not under compute in one step (:func:`last_step`), seconds: the mean over **all ranks**
    (every red piece of every rank's line in :func:`draw_replays`, summed, ÷ ranks)."""
    step = last_step(result, label)
    ranks = range(len(step.timelines))
    return sum(step.exposed(r) for r in ranks) / len(ranks)


def hidden_share(result, label: str = "step") -> float:
    """Share of the transfer time that ran under compute in one step (:func:`last_step`), over **all ranks**:
    Σ hidden / Σ comm (the green pieces of every rank's line in :func:`draw_replays` over green + red; 100 %
    only where no rank shows red)."""
    step = last_step(result, label)
    ranks = range(len(step.timelines))
    comm = sum(step.comm(r) for r in ranks)
    return sum(step.hidden(r) for r in ranks) / comm if comm else 0.0


def draw_replays(axes, results: dict, p: int, unit: float = 1e-3, unit_name: str = "ms", gap: int = -1):
    """One Gantt per ``{title: ReplayResult}`` on ``axes`` (:func:`minipar.pipeline.gantt.draw_gantt`), each
    showing one step in ``unit``: the one ending at "step" mark ``gap`` (-1: the last step)."""
    for ax, (title, result) in zip(axes, results.items()):
        times = [t for label, t in result.marks[0] if label == "step"]
        t0, t1 = times[gap - 1], times[gap]
        rows = [(r, k, s, i, a / unit, b / unit) for r, k, s, i, a, b in replay_rows(result, t0, t1)]
        draw_gantt(ax, rows, p, f"{title}: step {(t1 - t0) / unit:.3g} {unit_name}", labels=False)
        ax.set_xlabel(unit_name, fontsize=7)

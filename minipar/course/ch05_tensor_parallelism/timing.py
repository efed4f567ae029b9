"""Chapter 05, §9: TP inside a node vs across nodes — measured here, replayed here, replayed on H100 nodes.

The tiny GPT is trained tensor-parallel on t ranks here twice in one launch (:func:`tp_runs`), every rank
traced (:mod:`minipar.machine.trace`): once **timed** (its compute between collectives in thread CPU seconds,
every all-reduce with its bytes; the wall clock of its steps) and once more **counted** (``ops=True``: each
compute segment's operators — FLOPs, bytes, kernels — counted at PyTorch's dispatch level; counting slows
every operator, so this run's seconds are not used). One step of each (the last) is played by
:func:`minipar.machine.replay.replay` on

* ``here`` — this machine, the timed trace: compute as measured (CPU seconds, the one honest use of them),
  links of the α (one ring step) and β fitted to gloo's all-reduce here in the ring's form;
* ``inside`` — a model, the counted trace: one DGX H100 node (:func:`minipar.machine.cluster.h100_cluster`:
  H100 SXM card, NVLink 4 inside, InfiniBand NDR across), each compute segment its operators priced on the
  card (roofline + a launch floor per kernel, :mod:`minipar.machine.device`); t ≤ 8;
* ``across`` — the same card and links with the t ranks split over two nodes, t/2 in each
  (:func:`minipar.machine.cluster.gpu_cluster` with ``devices_per_node`` = t/2: every TP ring crosses
  InfiniBand): the placement a TP degree larger than a node forces (t = 16 on 8-GPU nodes).

Per placement, for the busiest rank of the step: compute, TP communication (time on the wire), step, and
their ratio (:func:`tp_table`); on the card, the compute split into matmuls, memory-bound operators and the
kernel floor (:func:`compute_terms`: kernels × the card's launch floor).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

from minipar.machine import trace
from minipar.machine.cluster import IB_NDR, NVLINK4, gpu_cluster, h100_cluster, this_machine
from minipar.machine.device import H100_SXM, Op, op_seconds
from minipar.machine.intervals import step_slice
from minipar.launcher import launch
from minipar.observe.measure import gather_steps, timed_steps
from minipar.machine.replay import replay
from minipar.tensor import gpt

__all__ = ["TPRuns", "tp_runs", "one_step", "placements", "compute_terms", "tp_table"]


class TPRuns(NamedTuple):
    """One launch of :func:`tp_runs`: the timed run (``measured``: wall seconds of each of its steps between two
    optimizer steps, each the slowest rank's; ``timed``: its Trace, compute in CPU seconds) and the counted run
    (``counted``: its Trace, each compute segment's operators; it trains ``counted_recipe``, the recipe's first
    steps), with each run's per-rank :class:`minipar.check.RunResult` (``results``, ``counted_results``: for
    :func:`minipar.check.compare` with ``train_reference`` of the recipe each trained)."""
    measured: list
    timed: trace.Trace
    counted: trace.Trace
    results: list
    counted_results: list
    counted_recipe: object


def _timed_then_counted(rank, world_size, recipe, counted_recipe):
    # the same program twice in the same processes (one launch, not two): first timed, nothing counted;
    # then once more with the operators counted, whose seconds are not used
    runs = []
    for run_recipe, ops in ((recipe, False), (counted_recipe, True)):
        with timed_steps(rank, ops=ops) as run:
            run.result = gpt.parallel_train(rank, world_size, run.stamped(copy.deepcopy(run_recipe)))
        runs.append(run)
    return runs


def tp_runs(recipe, t: int, counted_steps: int = 2) -> TPRuns:
    """``recipe`` trained with TP degree ``t`` on ``t`` ranks here, twice in one launch: a **timed** run (its
    steps on the wall clock, its compute in CPU seconds) and then a **counted** run of its first
    ``counted_steps`` steps (``ops=True``: counting slows every operator, so it is a run of its own, its seconds
    are not used, and it needs only the two steps that cut one out). Refused before any process starts where
    the recipe has fewer than 2 steps, ``counted_steps`` is not 2 … steps, or ``t`` does not split the heads."""
    if len(recipe.batches) < 2:
        raise ValueError("a step is timed between two optimizer steps: the recipe needs at least 2 steps")
    if not 2 <= counted_steps <= len(recipe.batches):
        raise ValueError(f"counted_steps must be 2 … {len(recipe.batches)} (the recipe's steps), got {counted_steps}")
    gpt.validate(recipe.model().cfg, tp=t, seq_len=recipe.batches[0][0].shape[1])
    counted_recipe = dataclasses.replace(recipe, batches=recipe.batches[:counted_steps])
    ranks = launch(_timed_then_counted, t, recipe, counted_recipe, quiet=True, timeout=300)
    timed, counted = (gather_steps([r[k] for r in ranks], {"t": t}) for k in (0, 1))
    return TPRuns(timed.seconds, timed.trace, counted.trace, timed.results, counted.results, counted_recipe)


def one_step(traced: trace.Trace, label: str = "step") -> trace.Trace:
    """The events of the last step alone (between the last two marks ``label`` on every rank): a trace
    that replays as one step, without the set-up and the final gather of the shards."""
    ranks = []
    for r in traced.ranks:
        try:
            events = step_slice(r.events, label, -1)
        except ValueError:
            raise ValueError(f"rank {r.rank}: fewer than two marks {label!r}") from None
        if any(isinstance(e, trace.Wait) or (isinstance(e, trace.Comm) and e.async_) for e in events):
            raise ValueError("one_step keeps blocking calls only (an async call's Wait index would move)")
        ranks.append(trace.RankTrace(r.rank, events))
    return trace.Trace(ranks, dict(traced.meta))


def placements(t: int, alpha: float | None = None, beta: float | None = None) -> dict:
    """{placement: Cluster or None}: this machine (α of one ring step, β; None when they are not given), the t
    ranks inside one DGX H100 node (None where t > 8), and split over two nodes, t/2 in each (None for t = 1)."""
    node = h100_cluster(1)
    here = this_machine(alpha, beta, 1.0, devices=max(t, 2)) if alpha is not None and beta is not None else None
    return {"here": here,
            "inside": node if t <= node.devices_per_node else None,
            "across": gpu_cluster(H100_SXM, 2, NVLINK4, IB_NDR, devices_per_node=t // 2) if t > 1 else None}


def compute_terms(rank_trace: trace.RankTrace, card=H100_SXM) -> dict:
    """The operators of one rank's compute segments priced on ``card`` (:func:`minipar.machine.device.op_seconds`),
    split: {"gemm": matmuls' roofline seconds, "memory": every other operator's, "floor": kernels × the launch
    floor, "kernels", "gemm_flops", "gemm_bytes": the matmuls' seconds at HBM speed alone (equal to "gemm" when
    every matmul is memory-bound)}; gemm + memory + floor is what a replay on the card gives the rank's compute."""
    out = {"gemm": 0.0, "memory": 0.0, "floor": 0.0, "kernels": 0, "gemm_flops": 0.0, "gemm_bytes": 0.0}
    for e in rank_trace.events:
        if not isinstance(e, trace.Compute):
            continue
        if e.ops is None:
            raise ValueError("compute_terms needs a trace counted with ops=True")
        for r in e.ops:
            bare = Op(r["name"], r["kind"], r["flops"], r["bytes"], 0, r["count"])   # no floor: the roofline alone
            out["gemm" if r["kind"] == "gemm" else "memory"] += op_seconds(bare, card)
            out["kernels"] += r["count"] * r.get("kernels", 1)
            out["gemm_flops"] += r["flops"] * r["count"] if r["kind"] == "gemm" else 0
            out["gemm_bytes"] += (r["bytes"] * r["count"] / (card.hbm_bandwidth * card.memory_efficiency)
                                  if r["kind"] == "gemm" else 0.0)
    out["floor"] = out["kernels"] * card.launch_floor
    return out


def tp_table(timed: trace.Trace, counted: trace.Trace | None, t: int, *, alpha: float | None = None,
             beta: float | None = None) -> dict:
    """{placement: {"compute", "comm", "exposed", "step", "ratio"} (seconds; ratio = comm / compute), or None
    where the placement is impossible} of the busiest rank of one step: ``timed`` (:func:`one_step` of
    :attr:`TPRuns.timed`) replayed here, ``counted`` (of :attr:`TPRuns.counted`) on the H100 placements
    (:func:`placements`), where each row adds the busiest rank's :func:`compute_terms`."""
    out = {}
    for name, cluster in placements(t, alpha, beta).items():
        step = timed if name == "here" else counted
        if cluster is None or step is None:
            out[name] = None
            continue
        played = replay(step, cluster, compute_scale=1.0) if name == "here" else replay(step, cluster)
        busiest = max(range(t), key=played.compute)
        compute, comm = played.compute(busiest), played.comm(busiest)
        out[name] = {"compute": compute, "comm": comm, "exposed": played.exposed(busiest),
                     "step": played.step_seconds, "ratio": comm / compute}
        if cluster.device is not None:
            out[name]["terms"] = compute_terms(step.ranks[busiest], cluster.device)
    return out

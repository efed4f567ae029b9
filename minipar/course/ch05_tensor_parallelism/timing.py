"""Chapter 05, §7: TP inside a node vs across nodes — measured here, replayed here, replayed on H100 nodes.

The tiny GPT is trained tensor-parallel on t ranks here, every rank traced (:mod:`minipar.observe.trace`: its compute
between collectives in thread CPU seconds, and every all-reduce with its bytes), a mark after each optimizer
step. One step of that trace (the last) is played by :func:`minipar.observe.replay.replay` on

* ``here`` — this machine: compute as measured (CPU seconds), links of the α, β fitted to gloo's all-reduce
  here (one ring step: α_allreduce / 2(N-1));
* ``inside`` — a model: two DGX H100 nodes (:func:`minipar.observe.cluster.h100_nodes`), the t ranks in one
  node (NVLink, 450 GB/s, 3 µs), compute scaled by this machine's matmul FLOP/s over the H100's 989 TFLOP/s
  × 0.6;
* ``across`` — the same devices with the t ranks split over two nodes, t/2 in each (so every TP ring
  crosses InfiniBand, 50 GB/s, 8 µs): the placement a TP degree larger than a node forces (t = 16 on 8-GPU
  nodes), or a layout that puts TP outermost.

Per placement, for the busiest rank of the step: compute, TP communication (time on the wire), step, and
their ratio (:func:`tp_table`).
"""
from __future__ import annotations

from dataclasses import replace

from minipar.observe import trace
from minipar.observe.cluster import h100_nodes, this_machine
from minipar.observe.intervals import step_slice
from minipar.observe.measure import measure_steps
from minipar.observe.replay import replay
from minipar.tensor import gpt

__all__ = ["traced_tp", "one_step", "placements", "tp_table"]


def traced_tp(recipe, t: int) -> tuple:
    """(measured wall seconds of the last step, slowest rank; :class:`minipar.observe.trace.Trace`; the ranks'
    :class:`minipar.check.RunResult`, for :func:`minipar.check.compare` with ``train_reference(recipe)``) of
    ``recipe`` trained with TP degree ``t`` on ``t`` ranks here (:func:`minipar.observe.measure.measure_steps`)."""
    if len(recipe.batches) < 2:
        raise ValueError("a step is timed between two optimizer steps: the recipe needs at least 2 steps")
    gpt.validate(recipe.model().cfg, tp=t, seq_len=recipe.batches[0][0].shape[1])
    steps = measure_steps(gpt.parallel_train, t, recipe, meta={"t": t})
    return steps.seconds[-1], steps.trace, steps.results


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


def placements(t: int, alpha: float, beta: float) -> dict:
    """{placement: Cluster or None}: this machine (α of one ring step, β), the t ranks inside one H100 node
    (None where t > 8), and split over two nodes."""
    nodes = h100_nodes(2)
    return {"here": this_machine(alpha, beta, 1.0, devices=max(t, 2)),
            "inside": nodes if t <= nodes.devices_per_node else None,
            "across": replace(nodes, devices_per_node=t // 2) if t > 1 else None}


def tp_table(step: trace.Trace, t: int, *, alpha: float, beta: float, flops_here: float) -> dict:
    """{placement: {"compute", "comm", "exposed", "step", "ratio"}} (seconds; ratio = comm / compute) of the
    busiest rank of ``step`` replayed on each of :func:`placements` (None where the placement is impossible)."""
    out = {}
    for name, cluster in placements(t, alpha, beta).items():
        if cluster is None:
            out[name] = None
            continue
        kw = {"compute_scale": 1.0} if name == "here" else {"source_flops_per_second": flops_here}
        played = replay(step, cluster, **kw)
        busiest = max(range(t), key=played.compute)
        compute, comm = played.compute(busiest), played.comm(busiest)
        out[name] = {"compute": compute, "comm": comm, "exposed": played.exposed(busiest),
                     "step": played.step_seconds, "ratio": comm / compute}
    return out

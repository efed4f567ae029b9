"""What-if at real size: the program a layout runs, written as a trace at a named model's size and played by the
replay engine on a carded cluster — the same model of time as :func:`minipar.plan.estimate`, one played on
the clock, the other summed in closed form; they must agree (tests/test_whatif.py).

Each rank of the layout's mesh runs its pipeline stage's schedule (:func:`minipar.pipeline.schedules.make_schedule`:
GPipe, 1F1B, ...; ``F`` and ``B`` actions), each action its stage's layers, each layer its operators
(:mod:`.operators`) cut by the tensor-parallel collectives Megatron issues — per layer, forward 2 all-reduces
(2 all-gathers + 2 reduce-scatters with SP), backward 2 all-reduces (4 all-gathers + 2 reduce-scatters with
SP: the activations gathered again for dW), and full recomputation the forward's again. Between stages an
activation goes forward and a gradient back (sends posted asynchronously, receives waited for); after the
last action each stage's gradients are all-reduced over dp in one call and Adam runs. Where a collective falls
inside a layer does not change the time of a program whose collectives block, so each layer's operators are
split evenly around them. Played here: dp, tp (± sp), pp with GPipe or 1F1B; not ZeRO, cp or ep (ValueError).
"""
from __future__ import annotations

from minipar.layout import Layout
from minipar.machine.device import Op, rows_of
from minipar.machine.replay import replay
from minipar.machine.trace import Comm, Compute, Mark, RankTrace, Trace
from minipar.mesh import Mesh
from minipar.pipeline.schedules import make_schedule

from .cost import estimate, stage_parameters
from .operators import MEGATRON_2022, head_step, layer_backward, layer_forward, optimizer_step

__all__ = ["layout_trace", "replay_layout", "planner_and_replay"]


def _split(ops: list, pieces: int) -> list:
    """``ops`` cut into ``pieces`` runs of about equal length (some may be empty)."""
    n = len(ops)
    return [ops[i * n // pieces:(i + 1) * n // pieces] for i in range(pieces)]


def _layer_calls(sp: bool, t: int, pass_: str, recompute: str) -> list:
    """The tp collectives of one layer's ``pass_`` ("F" or "B"), in order."""
    if t == 1:
        return []
    forward = ["all_gather", "reduce_scatter"] * 2 if sp else ["all_reduce"] * 2
    if pass_ == "F":
        return forward
    backward = ["all_gather", "all_gather", "reduce_scatter"] * 2 if sp else ["all_reduce"] * 2
    return (forward if recompute == "full" else []) + backward


class _Writer:
    """Appends one rank's events: compute segments of operators, calls on global ranks."""

    def __init__(self, rank):
        self.trace = RankTrace(rank)

    def compute(self, rows):
        if rows:                            # rows shared by every segment alike (the replay prices each once)
            self.trace.events.append(Compute(0.0, ops=rows))

    def call(self, op, ranks, payload, async_=False):
        self.trace.events.append(Comm(op, tuple(ranks), int(payload), async_))

    def mark(self, label="step"):
        self.trace.events.append(Mark(label))


def _layers(w, chunks, calls, group, payload):
    """One pass of a layer: its operators' ``chunks`` (rows) around its ``calls`` on ``group``."""
    for chunk, op in zip(chunks, calls + [None]):
        w.compute(chunk)
        if op is not None:
            w.call(op, group, payload)


def layout_trace(model, layout: Layout, kernels=MEGATRON_2022, e: int = 2, steps: int = 1) -> Trace:
    """The trace of ``steps`` steps of ``layout`` training ``model`` (see the module), marks "step" between."""
    if layout.zero or layout.cp > 1 or layout.ep > 1 or layout.v > 1:
        raise ValueError("the what-if plays dp, tp (± sp) and pp with one chunk per rank; not ZeRO, cp, ep or v > 1")
    mesh = Mesh(layout.devices, **layout.sizes)
    p, m, t, b = layout.pp, layout.micro_batches, layout.tp, layout.micro_batch
    forward = layer_forward(model, b, t, layout.sp, kernels, e)
    backward = layer_backward(forward, layout.recompute, kernels)
    head = head_step(model, b, t, kernels, e)
    act = b * model.seq_len * model.hidden * e                     # a tp collective's payload, a stage's send
    send = act / (t if layout.sp else 1)
    layers = model.layers // p
    params = stage_parameters(model, layout)
    embed, head = rows_of([Op("embedding", "memory", 0.0, 3.0 * act, 3)]), rows_of(head)
    calls = {x: _layer_calls(layout.sp, t, x, layout.recompute) for x in "FB"}
    chunks = {x: [rows_of(c) for c in _split(ops, len(calls[x]) + 1)] for x, ops in (("F", forward), ("B", backward))}
    ranks = []
    for rank in range(layout.devices):
        w, stage = _Writer(rank), mesh.coords(rank)["pp"]
        tp_group, dp_group = mesh.group_ranks("tp", rank), mesh.group_ranks("dp", rank)
        prev, after = (mesh.rank_at(rank, pp=stage + d) if 0 <= stage + d < p else None for d in (-1, 1))
        actions = make_schedule(layout.schedule, p, m).actions[stage] if p > 1 else \
            [a for i in range(m) for a in (_F(i), _B(i))]
        w.mark()
        for _ in range(steps):
            for a in actions:
                if a.kind == "F":
                    if prev is not None:
                        w.call("recv", (prev, rank), send)
                    w.compute(embed if stage == 0 else [])
                    for _ in range(layers):
                        _layers(w, chunks["F"], calls["F"], tp_group, act)
                    if after is not None:
                        w.call("send", (rank, after), send, async_=True)
                else:
                    if after is not None:
                        w.call("recv", (after, rank), send)
                    w.compute(head if after is None else [])
                    for _ in range(layers):
                        _layers(w, chunks["B"], calls["B"], tp_group, act)
                    if prev is not None:
                        w.call("send", (rank, prev), send, async_=True)
            held = params["first"] if stage == 0 else params["last"] if stage == p - 1 else \
                layers * params["layer"]
            if layout.dp > 1:
                w.call("all_reduce", dp_group, held * 2)
            w.compute(rows_of(optimizer_step(held)))
            w.mark()
        ranks.append(w.trace)
    return Trace(ranks, {"model": repr(model), "layout": str(layout), "kernels": kernels.name})


class _F:
    kind = "F"

    def __init__(self, i):
        self.microbatch = i


class _B(_F):
    kind = "B"


def replay_layout(model, layout, cluster, kernels=MEGATRON_2022, e: int = 2):
    """:func:`layout_trace` of two steps played on ``cluster`` (it needs a device card)."""
    if cluster.device is None:
        raise ValueError("the what-if prices operators: give a cluster with a device card (gpu_cluster, a100_cluster)")
    return replay(layout_trace(model, layout, kernels, e, steps=2), cluster)


def planner_and_replay(model, layout, cluster, kernels=MEGATRON_2022) -> dict:
    """{"planner": its step seconds, "replay": the replayed step (the second, on its slowest rank), "ratio"}."""
    planned = estimate(model, cluster, layout, kernels=kernels).step_seconds
    played = replay_layout(model, layout, cluster, kernels).step_gaps()[-1]
    return {"planner": planned, "replay": played, "ratio": played / planned}

"""Play a schedule on a clock: every rank runs its actions in order, each as soon as its inputs are there.

Dependencies (the data that must have arrived):

* ``F`` of stage s, micro-batch i needs F of stage s-1, i (an activation, one p2p transfer away);
* ``B``/``BW`` of stage s needs B/BW of stage s+1 (a gradient, one transfer away), or on the last stage
  its own F (the loss);
* ``W`` needs the B of the same stage and micro-batch (same rank, already done by order).

An action starts at max(rank free, inputs arrived) and lasts its cost. A stage is 1/v of a rank's layers,
so compute costs are divided by v; a transfer costs ``p2p`` whatever v (the activation has the same size).
If no rank can start its next action the schedule deadlocks, and :class:`ScheduleDeadlock` says who waits for what.

The clock is not this file's: the schedule is written as the trace its runtime would leave
(:func:`minipar.pipeline.schedule_trace.from_schedule`, its messages those of the one lowering,
:mod:`minipar.pipeline.lowering`) and played by the replay engine that plays measured runs
(:func:`minipar.machine.replay.replay`), compute scaled by 1. The replay's links carry one transfer at a time
each way; the simulator's are unlimited (each transfer costs ``p2p``, whatever else is in flight), so with
``p2p > 0`` every message is relayed by a wire of its own (:func:`through_wires`). A rank that waits for a
result it only makes later in its own list sends no message the replay could wait on: its list is cut there.

Results: per-rank timelines, makespan, the bubble in both conventions found in the literature, and the
peak number of micro-batches in flight per rank (forward done, weight gradient not yet: activations held).

* ``bubble_fraction`` = idle time / (p · makespan): the share of the step the ranks sit idle (GPipe,
  Huang et al. 2019: (p-1)/(m+p-1)); interleaving v chunks gives (p-1)/(v·m+p-1).
* ``bubble_ratio`` = idle time / busy time: the bubble over the ideal time of the work alone (Megatron-LM,
  Narayanan et al. 2021; the Ultra-Scale Playbook; *并行策略简介*): (p-1)/m, and exactly ÷ v interleaved.

Same schedule, same idle time, two denominators: ratio = fraction / (1 - fraction).

Besides: ``idle(r)`` (makespan minus rank r's work), ``peak_activations`` (peak in flight in units of one
whole rank-stage's activations: a chunk holds 1/v of them) and ``p2p_messages`` (transfers between ranks in
one step; a V's turn is on one rank and costs none). An F&B pair of DualPipeV (``Schedule.overlapped``) is
played as one block with ``overlap=True``: it starts when both its inputs are there.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..machine.cluster import Cluster
from ..machine.replay import Deadlock as ReplayDeadlock, replay
from ..machine.trace import Comm, Compute, RankTrace, Trace
from .actions import Action, Schedule, made, needs
from .lowering import lower
from .schedule_trace import consumers, from_lowered

__all__ = ["Costs", "Slot", "SimResult", "ScheduleDeadlock", "simulate", "through_wires", "in_flight_over_time"]


@dataclass(frozen=True)
class Costs:
    """Time of F, B (input gradient) and W (weight gradient) for a whole rank-stage, and of one transfer.
    The default F = B = W = 1 makes a full backward BW = B + W = 2 F, the usual assumption."""
    F: float = 1.0
    B: float = 1.0
    W: float = 1.0
    p2p: float = 0.0

    def of(self, kind: str, v: int = 1) -> float:
        base = {"F": self.F, "B": self.B, "W": self.W, "BW": self.B + self.W}[kind]
        return base / v


@dataclass(frozen=True)
class Slot:
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    schedule: Schedule
    costs: Costs
    timelines: list                                   # [[Slot]] per rank, in execution order
    transfers: list = field(default_factory=list)     # [(src rank, dst rank, start, end, "act"|"grad", Action)]

    @property
    def makespan(self) -> float:
        return max((s.end for tl in self.timelines for s in tl), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.timelines[rank])

    @property
    def bubble_fraction(self) -> float:
        """Idle time over all ranks / (p · makespan)."""
        p, total = self.schedule.p, self.makespan
        return 1 - sum(self.busy(r) for r in range(p)) / (p * total)

    @property
    def bubble_ratio(self) -> float:
        """Idle time over all ranks / their busy time (bubble time over ideal time, Megatron's convention)."""
        busy = sum(self.busy(r) for r in range(self.schedule.p))
        return (self.schedule.p * self.makespan - busy) / busy

    def idle(self, rank: int) -> float:
        """Time rank ``rank`` sits idle in the step: makespan minus its work."""
        return self.makespan - self.busy(rank)

    @property
    def p2p_messages(self) -> int:
        """Point-to-point transfers in one step (activations forward, gradients back)."""
        return len(self.transfers)

    @property
    def peak_activations(self) -> list:
        """Per rank, the peak in flight in units of one rank-stage's activations (a chunk is 1/v of it)."""
        return [n / self.schedule.v for n in self.peak_in_flight]

    @property
    def peak_in_flight(self) -> list:
        """Per rank, the most (stage, micro-batch) activations held at once."""
        return [max((n for _, n in in_flight_over_time(tl)), default=0) for tl in self.timelines]


class ScheduleDeadlock(RuntimeError):
    """No rank can start its next action: each waits for data that is never produced."""


def simulate(schedule: Schedule, costs: Costs = Costs(), overlap: bool = True) -> SimResult:
    """Run ``schedule`` on the clock; raise :class:`ScheduleDeadlock` if it cannot finish. ``overlap``: an F&B pair
    (``schedule.overlapped``) starts only when both its inputs are there (one block, as DualPipe runs it).
    The clock is the replay engine's (:func:`minipar.machine.replay.replay`) playing the schedule's trace
    (:func:`minipar.pipeline.schedule_trace.from_schedule`) with compute scale 1 and free links."""
    played = schedule if overlap else replace(schedule, overlapped=frozenset())
    cuts = [_local_cut(played, r) for r in range(schedule.p)]       # a rank that waits for its own later action
    runnable = replace(played, actions=[acts[:cut] for acts, cut in zip(played.actions, cuts)])
    lowered = lower(runnable)
    fed = consumers(lowered)                                        # {message: the action it feeds}
    trace = from_lowered(runnable, lowered, costs, fed=fed)
    if costs.p2p:
        trace = through_wires(trace, costs.p2p)
    world = trace.world_size
    links = Cluster(devices_per_node=world, nodes=1, memory_bytes=0.0, peak_flops=1.0, intra_bw=float("inf"),
                    inter_bw=float("inf"))
    try:
        res = replay(trace, links, compute_scale=1.0, comm_time=lambda *_: 0.0)
    except ReplayDeadlock as err:
        raise _deadlock(played, cuts, err.calls) from None
    if any(cut < len(acts) for acts, cut in zip(played.actions, cuts)):
        raise _deadlock(played, cuts, {})
    timelines = []
    for r, acts in enumerate(played.actions):
        spans = sorted((s for s in res.timelines[r] if s.kind == "compute"), key=lambda s: s.index)
        timelines.append([Slot(a, s.start, s.end) for a, s in zip(acts, spans)])
    return SimResult(schedule, costs, timelines, _transfers(played, fed, timelines, costs.p2p))


def through_wires(trace: Trace, p2p: float) -> Trace:
    """``trace`` with every message relayed by a wire of its own (an extra rank that receives it, holds it
    ``p2p`` seconds and hands it on): a transfer costs ``p2p`` and never queues behind another, the
    simulator's unlimited links (the replay's own links carry one transfer at a time each way)."""
    ranks = [RankTrace(r.rank, [replace(e) for e in r.events]) for r in trace.ranks]
    wires = {}                                               # (src, dst, tag) -> wire rank
    for r in ranks:
        for e in r.events:
            if isinstance(e, Comm) and e.op in ("send", "recv"):
                peer = next(q for q in e.ranks if q != r.rank)
                src, dst = (r.rank, peer) if e.op == "send" else (peer, r.rank)
                wire = wires.setdefault((src, dst, e.tag), len(trace.ranks) + len(wires))
                e.ranks = (r.rank, wire)
    for (src, dst, tag), wire in wires.items():
        ranks.append(RankTrace(wire, [Comm("recv", (src, wire), 0, tag=tag), Compute(p2p),
                                      Comm("send", (wire, dst), 0, tag=tag)]))
    return Trace(ranks, dict(trace.meta))


def _local_cut(schedule: Schedule, r: int) -> int:
    """Index of rank r's first block (action, or F&B pair) that needs a result this rank makes only later or
    never (it waits forever: no message will come); the list's length if none."""
    last, acts, produced, i = schedule.num_stages - 1, schedule.actions[r], set(), 0
    while i < len(acts):
        n = 2 if (r, i) in schedule.overlapped else 1
        for a in acts[i:i + n]:
            need = needs(a, last)
            local = need is not None and (need[1] == a.stage or schedule.rank_of(need[1]) == r)
            if local and need not in produced:
                return i
        produced |= {made(a) for a in acts[i:i + n]}
        i += n
    return len(acts)


def _deadlock(schedule: Schedule, cuts: list, calls: dict) -> ScheduleDeadlock:
    """Who waits before which action for what: the replay's blocked ranks (``calls``: rank -> the
    :class:`~minipar.machine.replay.WaitedCall`, whose tag names the action), then the ranks stuck at their
    own later action."""
    waiting = []
    for r, acts in enumerate(schedule.actions):
        if r in calls:
            k = next(k for k, a in enumerate(acts) if str(a) == calls[r].tag)
            k -= (r, k - 1) in schedule.overlapped                   # an F&B pair waits as one block
        elif cuts[r] < len(acts):
            k = cuts[r]
        else:
            continue
        waiting.append(f"rank {r} waits before {acts[k]} for {needs(acts[k], schedule.num_stages - 1)}")
    return ScheduleDeadlock("the schedule deadlocks: " + "; ".join(waiting))


def _transfers(schedule: Schedule, fed: dict, timelines: list, p2p: float) -> list:
    """[(src, dst, start, end, "act" | "grad", the action it feeds)]: each message of the lowering (``fed``:
    :func:`~minipar.pipeline.schedule_trace.consumers` of it), from the end of the action that made it."""
    ended = {made(s.action): s.end
             for tl in timelines for s in tl}
    out = []
    for msg, a in fed.items():
        at = ended[needs(a, schedule.num_stages - 1)]
        out.append((msg.src, msg.dst, at, at + p2p, msg.what, a))
    return out


def in_flight_over_time(timeline: list) -> list:
    """[(time, activations held)] for one rank: +1 when an F ends, -1 when its BW or W ends."""
    events = []
    for s in timeline:
        if s.action.kind == "F":
            events.append((s.end, +1))
        elif s.action.kind in ("BW", "W"):
            events.append((s.end, -1))
    events.sort(key=lambda e: (e[0], e[1]))          # at equal times free first
    held, out = 0, []
    for t, d in events:
        held += d
        out.append((t, held))
    return out

"""Play a schedule on a clock: every rank runs its actions in order, each as soon as its inputs are there.

Dependencies (the data that must have arrived):

* ``F`` of stage s, micro-batch i needs F of stage s-1, i (an activation, one p2p transfer away);
* ``B``/``BW`` of stage s needs B/BW of stage s+1 (a gradient, one transfer away), or on the last stage
  its own F (the loss);
* ``W`` needs the B of the same stage and micro-batch (same rank, already done by order).

An action starts at max(rank free, inputs arrived) and lasts its cost. A stage is 1/v of a rank's layers,
so compute costs are divided by v; a transfer costs ``p2p`` whatever v (the activation has the same size).
If no rank can start its next action the schedule deadlocks, and :class:`Deadlock` says who waits for what.

Results: per-rank timelines, makespan, the bubble in both conventions found in the literature, and the
peak number of micro-batches in flight per rank (forward done, weight gradient not yet: activations held).

* ``bubble_fraction`` = idle time / (p · makespan): the share of the step the ranks sit idle (GPipe,
  Huang et al. 2019: (p-1)/(m+p-1)); interleaving v chunks gives (p-1)/(v·m+p-1).
* ``bubble_ratio`` = idle time / busy time: the bubble over the ideal time of the work alone (Megatron-LM,
  Narayanan et al. 2021; the Ultra-Scale Playbook; seed 000): (p-1)/m, and exactly ÷ v interleaved.

Same schedule, same idle time, two denominators: ratio = fraction / (1 - fraction).

Besides: ``idle(r)`` (makespan minus rank r's work), ``peak_activations`` (peak in flight in units of one
whole rank-stage's activations: a chunk holds 1/v of them) and ``p2p_messages`` (transfers between ranks in
one step; a V's turn is on one rank and costs none). An F&B pair of DualPipeV (``Schedule.overlapped``) is
played as one block with ``overlap=True``: it starts when both its inputs are there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .schedules import Action, Schedule, needs

__all__ = ["Costs", "Slot", "SimResult", "Deadlock", "simulate", "in_flight_over_time"]


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


class Deadlock(RuntimeError):
    """No rank can start its next action: each waits for data that is never produced."""


def _producer(a: Action, s: Schedule):
    """The action whose result ``a`` needs (None: no input)."""
    return needs(a, s.num_stages - 1)


def simulate(schedule: Schedule, costs: Costs = Costs(), overlap: bool = True) -> SimResult:
    """Run ``schedule`` on the clock; raise :class:`Deadlock` if it cannot finish. ``overlap``: an F&B pair
    (``schedule.overlapped``) starts only when both its inputs are there (one block, as DualPipe runs it)."""
    p = schedule.p
    pos = [0] * p                        # index of each rank's next action
    free = [0.0] * p                     # when each rank is free
    done = {}                            # (kind, stage, mb) -> end time; BW counts as B (and W)
    timelines = [[] for _ in range(p)]
    transfers = []
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule.actions[r]):
                n = 2 if overlap and (r, pos[r]) in schedule.overlapped else 1
                block = schedule.actions[r][pos[r]:pos[r] + n]
                ready = _inputs_ready(block, schedule, r, done, costs, transfers)
                if ready is None:
                    break
                start = max(free[r], ready)
                for a in block:
                    end = start + costs.of(a.kind, schedule.v)
                    timelines[r].append(Slot(a, start, end))
                    done[("B" if a.kind == "BW" else a.kind, a.stage, a.microbatch)] = end
                    start = end
                free[r] = start
                pos[r] += n
                remaining -= n
                progressed = True
        if not progressed:
            waiting = [f"rank {r} waits before {schedule.actions[r][pos[r]]} for "
                       f"{_producer(schedule.actions[r][pos[r]], schedule)}"
                       for r in range(p) if pos[r] < len(schedule.actions[r])]
            raise Deadlock("the schedule deadlocks: " + "; ".join(waiting))
    return SimResult(schedule, costs, timelines, transfers)


def _inputs_ready(block: list, schedule: Schedule, r: int, done: dict, costs: Costs, transfers: list):
    """When every input of ``block`` (one action, or an F&B pair) has arrived on rank r; None: not yet
    produced. Records the transfers (once, when the block can start)."""
    ready, moves = 0.0, []
    for a in block:
        need = _producer(a, schedule)
        if need is None:
            continue
        if need not in done:
            return None
        at = done[need]
        src = schedule.rank_of(need[1])
        if need[1] != a.stage and src != r:      # crosses ranks: one transfer
            moves.append((src, r, at, at + costs.p2p, "act" if a.kind == "F" else "grad", a))
            at += costs.p2p
        ready = max(ready, at)
    transfers.extend(moves)
    return ready


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

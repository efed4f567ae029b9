"""Stragglers: which rank makes every other rank wait, and what it costs the step, from a trace.

In a synchronous step every rank waits in the first collective for the slowest rank to arrive: one slow rank
(a thermally throttled GPU, a noisy neighbour, a bigger shard of data) sets the pace of all of them, and on
the other ranks its extra time shows up as time *inside* the collective, not as compute. So the rank that
waits least in communication is the straggler, and its extra compute over the median of the other ranks is what
the step pays for it.

:func:`per_rank_steps` splits each rank's events of a :class:`minipar.machine.trace.Trace` at its marks
``"step"`` into compute (wall seconds between calls) and communication (wall seconds inside calls, the wait
for the slowest rank included). :func:`find_straggler` names the rank. :func:`without_straggler` is the model
counterfactual: the same trace with the straggler's compute segments cut to the other ranks' median, to be replayed
(:func:`minipar.machine.replay.replay`) beside the original on a declared cluster.

Source: Meta's Llama 3 report ("The Llama 3 Herd of Models", 2024, §3.3.4) on slow ranks among 16k GPUs
found with tools built on its NCCLX flight recorder; the signal read here (the others' wait inside the
collective) is the replay's idle time (:mod:`minipar.machine.replay_result`), measured instead of modelled.
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

from minipar.machine.intervals import step_slice
from minipar.machine.trace import Comm, Compute, Trace

__all__ = ["StepTimes", "per_rank_steps", "Straggler", "find_straggler", "without_straggler"]


@dataclass
class StepTimes:
    """One rank's steps: ``compute`` and ``comm`` wall seconds per step (comm includes waiting for peers)."""
    rank: int
    compute: list
    comm: list

    @property
    def total(self) -> list:
        return [a + b for a, b in zip(self.compute, self.comm)]


def _steps(events, label):
    marks = sum(1 for e in events if getattr(e, "kind", None) == "mark" and e.label == label)
    return [step_slice(events, label, k) for k in range(max(marks - 1, 0))]


def per_rank_steps(trace: Trace, label: str = "step", clock: str = "wall") -> list:
    """A :class:`StepTimes` per rank, one entry per interval between two marks ``label``. ``clock``: compute
    in ``"wall"`` seconds, or in the thread's ``"cpu"`` seconds — on a machine whose cores are shared (more
    ranks than cores, other jobs), a rank's wall time also counts the time it waited for a core, and only
    its CPU time says how much work it did. Communication is always wall time (the wait is the point)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock is 'wall' or 'cpu', got {clock!r}")
    out = []
    for r in trace.ranks:
        steps = _steps(r.events, label)
        seconds = (lambda e: e.seconds_cpu) if clock == "cpu" else (lambda e: e.seconds_wall)
        out.append(StepTimes(r.rank, [sum(seconds(e) for e in s if isinstance(e, Compute)) for s in steps],
                             [sum(e.seconds_wall for e in s if isinstance(e, Comm)) for s in steps]))
    return out


@dataclass
class Straggler:
    """The slow rank: its median compute per step, the other ranks' median, and ``cost``: the difference,
    what every step pays for it (the others spend it waiting inside the collectives)."""
    rank: int
    compute: float
    others_compute: float
    others_wait: float
    own_wait: float
    step: float

    @property
    def cost(self) -> float:
        return self.compute - self.others_compute

    def __str__(self) -> str:
        ms = lambda s: f"{s * 1e3:.1f} ms"     # noqa: E731
        return (f"rank {self.rank} is the straggler: it computes {ms(self.compute)} a step, the others "
                f"{ms(self.others_compute)} (median); they wait {ms(self.others_wait)} inside the collectives, "
                f"it waits {ms(self.own_wait)}. It costs every step about {ms(self.cost)} of {ms(self.step)} "
                f"({100 * self.cost / self.step:.0f} %).")


def find_straggler(trace: Trace, label: str = "step", skip: int = 1, clock: str = "wall") -> Straggler:
    """The rank with the most compute per step (median over steps, the first ``skip`` left out: set-up;
    ``clock`` as in :func:`per_rank_steps`). Its cost is its compute minus the median of the other ranks'."""
    steps = per_rank_steps(trace, label, clock)
    if not steps or len(steps[0].compute) <= skip:
        raise ValueError(f"need more than {skip} steps between marks {label!r}")
    med = lambda xs: statistics.median(xs[skip:])     # noqa: E731
    compute = {s.rank: med(s.compute) for s in steps}
    slow = max(compute, key=compute.get)
    others = [s for s in steps if s.rank != slow]
    step = max(med(s.total) for s in steps)
    return Straggler(slow, compute[slow], statistics.median(compute[s.rank] for s in others),
                     statistics.median(med(s.comm) for s in others), med(steps[slow].comm), step)


def without_straggler(trace: Trace, rank: int) -> Trace:
    """A copy of ``trace`` in which rank ``rank``'s compute segments last what the median other rank's do,
    segment by segment (same program, so the same segments): what the run would be without the straggler.
    Counted operators go with the time: each segment takes the ops of the other rank whose CPU seconds are
    the median (the lower of the two middle ones), so that a replay on a device card, which prices ops, sees
    the cut too. A model: replay both on the same declared cluster and compare their steps."""
    out = copy.deepcopy(trace)
    others = [r for r in out.ranks if r.rank != rank]
    mine = [e for e in out.ranks[rank].events if isinstance(e, Compute)]
    theirs = [[e for e in r.events if isinstance(e, Compute)] for r in others]
    if any(len(t) != len(mine) for t in theirs):
        raise ValueError("the ranks ran different programs (different numbers of compute segments)")
    for i, e in enumerate(mine):
        e.seconds_cpu = statistics.median(t[i].seconds_cpu for t in theirs)
        e.seconds_wall = statistics.median(t[i].seconds_wall for t in theirs)
        e.flops = None if e.flops is None else statistics.median(t[i].flops for t in theirs)
        typical = sorted((t[i] for t in theirs), key=lambda x: x.seconds_cpu)[(len(theirs) - 1) // 2]
        e.ops = None if e.ops is None else typical.ops
    return out

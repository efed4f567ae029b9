"""What a replay returns (:func:`minipar.machine.replay.replay`), and how it is read: each rank's bars, and its
time split into compute, communication hidden under compute, exposed communication, and idle."""
from __future__ import annotations

from dataclasses import dataclass, field

from minipar.machine.cluster import Cluster
from minipar.machine.intervals import difference, intersection, length, slowest_rank_steps, union

__all__ = ["Span", "ReplayResult"]


@dataclass(frozen=True)
class Span:
    """One bar: ``kind`` "compute" or the op; ``index`` the event's index in the rank's trace."""
    rank: int
    kind: str
    start: float
    end: float
    index: int


@dataclass
class ReplayResult:
    timelines: list                      # [[Span]] per rank: computes and the transfers it takes part in
    finish: list                         # when each rank ran out of events
    cluster: Cluster | None = None
    calls: list = field(default_factory=list)   # [(op, ranks, start, end)]: a collective, or a "send" (src, dst)
    marks: list = field(default_factory=list)   # [[(label, time)]] per rank: where its Marks fell

    def step_gaps(self, label: str = "step") -> list:
        """The step times, one per step: from one mark ``label`` to the next on the slowest rank
        (:func:`slowest_rank_steps`), as the clock between two optimizer steps of a run times a step."""
        return slowest_rank_steps([[t for name, t in marks if name == label] for marks in self.marks],
                                  what=f"marks {label!r}")

    def step_between(self, label: str) -> float:
        """One step as a run times it: the fastest step of :meth:`step_gaps` (each timed on its slowest rank;
        the first step often carries set-up)."""
        return min(self.step_gaps(label))

    @property
    def step_seconds(self) -> float:
        return max(self.finish, default=0.0)

    def pieces(self, rank: int, start: float = 0.0, end: float | None = None) -> dict:
        """``rank``'s time in [start, end] (default the whole replay) as sets of intervals
        (:mod:`minipar.machine.intervals`): "compute"; the union of its transfers (a send and a recv at once count
        once) under its compute, "comm hidden", and not, "comm exposed"; "idle": neither. They tile the window."""
        end = self.step_seconds if end is None else end
        window = [(start, end)] if end > start else []
        spans = self.timelines[rank]
        work = intersection(union((s.start, s.end) for s in spans if s.kind == "compute"), window)
        wire = intersection(union((s.start, s.end) for s in spans if s.kind != "compute"), window)
        return {"compute": work, "comm hidden": intersection(wire, work), "comm exposed": difference(wire, work),
                "idle": difference(window, union(work + wire))}

    def totals(self, rank: int) -> dict:
        """Seconds of each of :meth:`pieces`: compute + comm exposed + idle = the step (hidden is under compute)."""
        return {kind: length(got) for kind, got in self.pieces(rank).items()}

    def compute(self, rank: int) -> float:
        return self.totals(rank)["compute"]

    def comm(self, rank: int) -> float:
        return self.hidden(rank) + self.exposed(rank)

    def hidden(self, rank: int) -> float:
        """Transfer time of ``rank`` that overlaps its own compute."""
        return self.totals(rank)["comm hidden"]

    def exposed(self, rank: int) -> float:
        return self.totals(rank)["comm exposed"]

    def idle(self, rank: int) -> float:
        return self.totals(rank)["idle"]

    def table(self) -> list:
        """One dict per rank: compute, hidden, exposed, idle (seconds)."""
        return [{"rank": r, "compute": t["compute"], "hidden": t["comm hidden"], "exposed": t["comm exposed"],
                 "idle": t["idle"]} for r, t in enumerate(map(self.totals, range(len(self.timelines))))]

    def summary(self) -> str:
        return "\n".join([f"step {self.step_seconds * 1e3:.3f} ms"] + [
            f"rank {t['rank']}: compute {t['compute'] * 1e3:.3f} ms, comm hidden {t['hidden'] * 1e3:.3f} ms, "
            f"exposed {t['exposed'] * 1e3:.3f} ms, idle {t['idle'] * 1e3:.3f} ms" for t in self.table()])

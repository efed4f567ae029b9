"""A trace of what every rank did: its compute segments between communication calls, and the calls.

Measure what the program does, then play it on a declared machine (FlexFlow's simulator, Jia et al. 2019;
ASTRA-sim, Rashidi et al. 2020; Calculon, Isaev et al. 2023): this module is the program, as measured (or
built from a schedule), :mod:`minipar.machine.replay` the playing half. Per rank, in program order, a trace holds

* :class:`Compute` — this rank's thread's time between two communication calls, in **thread CPU time**
  (what the thread itself ran: shared cores do not inflate it) beside the wall time; optionally its FLOPs
  and its operators (what a GPU would launch: :mod:`minipar.observe.opcount`);
* :class:`Comm` — one call of :mod:`minipar.comm`: op, the group's global ranks, payload bytes, blocking or
  async, and for an async call the index of the :class:`Wait` event where the program waited for it
  (None: never waited for — the replay waits at the rank's end);
* :class:`Wait` — where an async call was waited for (``work.wait()``);
* :class:`Mark` — a label put there with :func:`minipar.observe.tracer.mark` (a step's end: where a replay's
  steps end).

This module is the format only (pure data: it imports no communication code). A trace is recorded by
:mod:`minipar.observe.tracer` (``with tracing() as rank_trace:`` on a rank; a hook on :mod:`minipar.comm`'s
calls, so no strategy holds tracing code), or for every rank of a launch by
:func:`minipar.observe.launch_trace.traced_launch`. A trace is data: :meth:`Trace.save` / :func:`load` (JSON),
:meth:`Trace.summary`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["Compute", "Comm", "Wait", "Mark", "RankTrace", "Trace", "load"]


@dataclass
class Compute:
    """Work between two communication calls: thread CPU seconds, wall seconds, FLOPs if known, the CPU
    seconds the rank's *other* threads (gloo's, moving and summing bytes) used meanwhile, and, if counted,
    its operators (``ops``: rows of :meth:`minipar.observe.opcount.OperatorCounter.take`)."""
    seconds_cpu: float
    seconds_wall: float = 0.0
    flops: float | None = None
    kind: str = "compute"
    seconds_other_threads: float = 0.0
    ops: list | None = None


@dataclass
class Comm:
    """One communication call. ``ranks``: the group's global ranks (a send/recv: the pair); ``bytes``: the
    payload S of :mod:`minipar.comm`'s table; ``async_``: issued with ``async_op=True`` / isend / irecv;
    ``waited_at``: index of its :class:`Wait` in the rank's events (None: blocking, or never waited for);
    ``tag``: tells messages between the same two ranks apart (None: matched first in, first out)."""
    op: str
    ranks: tuple
    bytes: int
    async_: bool = False
    waited_at: int | None = None
    seconds_wall: float = 0.0
    tag: str | None = None
    kind: str = "comm"

    def __post_init__(self):
        self.ranks = tuple(self.ranks)


@dataclass
class Wait:
    """The program waited here for the async :class:`Comm` at index ``comm`` of the same rank."""
    comm: int
    kind: str = "wait"


@dataclass
class Mark:
    """A point the program labelled with :func:`minipar.observe.tracer.mark`."""
    label: str
    kind: str = "mark"


_KINDS = {"compute": Compute, "comm": Comm, "wait": Wait, "mark": Mark}


@dataclass
class RankTrace:
    """One rank's events in program order."""
    rank: int
    events: list = field(default_factory=list)

    def comms(self) -> list:
        return [e for e in self.events if isinstance(e, Comm)]

    @property
    def compute_cpu_seconds(self) -> float:
        return sum(e.seconds_cpu for e in self.events if isinstance(e, Compute))


@dataclass
class Trace:
    """Every rank's :class:`RankTrace`; ``meta`` says where it was measured (e.g. ``flops_per_second`` of a
    rank here, which :mod:`minipar.machine.replay` scales compute by)."""
    ranks: list
    meta: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict:
        return {"meta": self.meta, "ranks": [{"rank": r.rank, "events": [asdict(e) for e in r.events]}
                                             for r in self.ranks]}

    @classmethod
    def from_dict(cls, data: dict) -> "Trace":
        def event(d):
            d = dict(d)
            return _KINDS[d["kind"]](**d)
        return cls([RankTrace(r["rank"], [event(e) for e in r["events"]]) for r in data["ranks"]],
                   dict(data.get("meta", {})))

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    def summary(self) -> str:
        """One line per rank: events, compute CPU seconds, calls per op with their bytes."""
        lines = []
        for r in self.ranks:
            ops: dict = {}
            for c in r.comms():
                calls, nbytes = ops.get(c.op, (0, 0))
                ops[c.op] = (calls + 1, nbytes + c.bytes)
            table = ", ".join(f"{op} {n}x {b / 1e6:.3g} MB" for op, (n, b) in sorted(ops.items()))
            lines.append(f"rank {r.rank}: {len(r.events)} events, compute {r.compute_cpu_seconds * 1e3:.2f} ms "
                         f"CPU; {table or 'no communication'}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def load(path) -> Trace:
    with open(path) as f:
        return Trace.from_dict(json.load(f))

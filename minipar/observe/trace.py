"""A trace of what every rank did: its compute segments between communication calls, and the calls.

Measure what the program does, then play it on a declared machine (FlexFlow's simulator, Jia et al. 2019;
ASTRA-sim, Rashidi et al. 2020; Calculon, Isaev et al. 2023): this module is the measuring half,
:mod:`minipar.observe.replay` the playing half. Per rank, in program order, a trace holds

* :class:`Compute` — this rank's thread's time between two communication calls, in **thread CPU time**
  (what the thread itself ran: shared cores do not inflate it) beside the wall time; optionally its FLOPs;
* :class:`Comm` — one call of :mod:`minipar.comm`: op, the group's global ranks, payload bytes, blocking or
  async, and for an async call the index of the :class:`Wait` event where the program waited for it
  (None: never waited for — the replay waits at the rank's end);
* :class:`Wait` — where an async call was waited for (``work.wait()``);
* :class:`Mark` — a label put there with :func:`mark` (a step's end: where a replay's steps end).

Recording lives in :mod:`minipar.comm` (hooks before each call and on each record), so no strategy holds
tracing code: ``with tracing() as rank_trace:`` on a rank, or :func:`run_traced` around a ``parallel_train``. A trace is data: :meth:`Trace.save` / :func:`load` (JSON), :meth:`Trace.summary`.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field

__all__ = ["Compute", "Comm", "Wait", "Mark", "RankTrace", "Trace", "tracing", "mark", "position", "run_traced",
           "load", "Traced", "from_schedule"]


@dataclass
class Compute:
    """Work between two communication calls: thread CPU seconds, wall seconds, FLOPs if known, and the CPU
    seconds the rank's *other* threads (gloo's, moving and summing bytes) used meanwhile."""
    seconds_cpu: float
    seconds_wall: float = 0.0
    flops: float | None = None
    kind: str = "compute"
    seconds_other_threads: float = 0.0


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
    """A point the program labelled with :func:`mark`."""
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
    rank here, which :mod:`minipar.observe.replay` scales compute by)."""
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


class _Tracer:
    """Told by :mod:`minipar.comm` before each call (closes the compute segment) and of each record."""

    def __init__(self, rank: int, counter=None):
        self.trace, self._counter, self._flops = RankTrace(rank), counter, 0
        self._mark()

    def _mark(self) -> None:
        self._cpu, self._wall, self._process = time.thread_time(), time.perf_counter(), time.process_time()

    def before_call(self) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        flops = None
        if self._counter is not None:             # FLOPs counted since the segment began
            total = self._counter.get_total_flops()
            flops, self._flops = float(total - self._flops), total
        others = max(0.0, time.process_time() - self._process - (cpu - self._cpu))
        self.trace.events.append(Compute(cpu - self._cpu, wall - self._wall, flops, seconds_other_threads=others))
        self._wall = wall

    def on_record(self, rec, work):
        """Append the call; wrap an async work so its ``wait()`` is seen. Returns the work to hand back."""
        events = self.trace.events
        events.append(Comm(rec.op, rec.ranks, rec.payload_bytes, work is not None, None,
                           time.perf_counter() - self._wall))
        index = len(events) - 1
        self._mark()
        return work if work is None else _WaitSeen(work, self, index)

    def waited(self, index: int, wall_before: float) -> None:
        self.trace.events.append(Wait(index))
        self.trace.events[index].waited_at = len(self.trace.events) - 1
        self._mark()

    def mark(self, label: str) -> None:
        self.before_call()
        self.trace.events.append(Mark(label))
        self._mark()

    def finish(self) -> RankTrace:
        self.before_call()                   # the work after the last call
        return self.trace


class _WaitSeen:
    """An async work whose first ``wait()`` adds a :class:`Wait` event; everything else is the work's."""

    def __init__(self, work, tracer: _Tracer, index: int):
        self._work, self._tracer, self._index, self._seen = work, tracer, index, False

    def wait(self, *args, **kwargs):
        if self._seen:
            return self._work.wait(*args, **kwargs)
        self._tracer.before_call()
        wall = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        self._seen = True
        self._tracer.waited(self._index, wall)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def tracing(rank: int | None = None, flops: bool = False):
    """Trace this rank's communication calls and the compute between them inside the block; yields the
    :class:`RankTrace`, complete when the block ends. Opens a :func:`minipar.comm.recording` of its own.
    ``flops=True``: each segment's matmul FLOPs too (``torch.utils.flop_counter.FlopCounterMode``; it
    slows every op, so time such a run for its FLOPs, not its seconds)."""
    from minipar import comm
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    counter = FlopCounterMode(display=False) if flops else None
    tracer = _Tracer(rank, counter)
    comm._tracers.append(tracer)
    try:
        with comm.recording(), counter if flops else contextlib.nullcontext():
            yield tracer.trace
    finally:
        comm._tracers.remove(tracer)
        tracer.finish()


def mark(label: str) -> None:
    """Put a :class:`Mark` into every trace recording on this rank (nothing when none is)."""
    from minipar import comm
    for tracer in comm._tracers:
        tracer.mark(label)


def position():
    """Where this rank is in its innermost trace: (the index its open compute segment will take, the thread
    CPU seconds that segment has run so far) — to place an observation (live memory, say) on a replay's time
    axis; None when no trace is recording."""
    from minipar import comm
    if not comm._tracers:
        return None
    tracer = comm._tracers[-1]
    return len(tracer.trace.events), time.thread_time() - tracer._cpu


class Traced:
    """``fn`` (a ``parallel_train``) run under :func:`tracing`: returns ``(fn's result, RankTrace)``.
    A class, not a closure, so that the launcher can pickle it for spawned ranks."""

    def __init__(self, fn, flops: bool = False):
        self.fn, self.flops = fn, flops

    def __call__(self, rank: int, world_size: int, *args, **kwargs):
        with tracing(rank, flops=self.flops) as rank_trace:
            result = self.fn(rank, world_size, *args, **kwargs)
        return result, rank_trace


def run_traced(fn, world_size: int, *args, meta: dict | None = None, **kwargs):
    """``minipar.launch(fn, world_size, *args, **kwargs)`` with every rank traced: (results, :class:`Trace`)."""
    from minipar.launcher import launch
    out = launch(Traced(fn), world_size, *args, **kwargs)
    return [r for r, _ in out], Trace([t for _, t in out], dict(meta or {}))


def from_schedule(schedule, costs, message_bytes: int = 0) -> Trace:
    """The trace a pipeline runtime would leave running ``schedule`` (:mod:`minipar.pipeline.schedules`)
    with compute costed by ``costs`` (:class:`minipar.pipeline.simulate.Costs`): every receive posted at
    the start (async) and waited for right before the action that needs it, every result sent (async) to
    the rank that needs it as soon as it is computed, each message tagged with the action it feeds. Its
    replay with links of α = ``costs.p2p`` is the pipeline simulator's timeline (tests/test_replay.py)."""
    from minipar.pipeline.schedules import needs            # (the library's pipeline schedules: imported when used)
    last, ranks = schedule.num_stages - 1, range(schedule.p)
    consumers: dict = {}                                 # result -> [(rank, action)] on other ranks
    for r in ranks:
        for a in schedule.actions[r]:
            need = needs(a, last)
            if need is not None and need[1] != a.stage and schedule.rank_of(need[1]) != r:
                consumers.setdefault(need, []).append((r, a))
    traces = []
    for r in ranks:
        events, posted = [], {}
        for a in schedule.actions[r]:
            need = needs(a, last)
            if need in consumers and (r, a) in consumers[need]:
                src = schedule.rank_of(need[1])
                posted[a] = len(events)
                events.append(Comm("recv", tuple(sorted((r, src))), message_bytes, True, tag=str(a)))
        actions, i = schedule.actions[r], 0
        while i < len(actions):
            n = 2 if (r, i) in schedule.overlapped else 1    # an F&B pair starts when both inputs are there
            for a in actions[i:i + n]:
                if a in posted:
                    events.append(Wait(posted[a]))
                    events[posted[a]].waited_at = len(events) - 1
            for a in actions[i:i + n]:
                events.append(Compute(costs.of(a.kind, schedule.v)))
                made = ("B" if a.kind == "BW" else a.kind, a.stage, a.microbatch)
                for dst, c in consumers.get(made, []):
                    events.append(Comm("send", tuple(sorted((r, dst))), message_bytes, True, tag=str(c)))
            i += n
        traces.append(RankTrace(r, events))
    return Trace(traces, {"schedule": schedule.name, "p": schedule.p, "m": schedule.m, "v": schedule.v})

"""Play a :mod:`minipar.machine.trace` on a declared cluster: what the measured program would do on that machine.

Each rank is a device that runs its events in order (FlexFlow's simulator, Jia et al. 2019; ASTRA-sim,
Rashidi et al. 2020, play the same kind of graph):

* a :class:`~minipar.machine.trace.Compute` on a cluster with a device card (:mod:`minipar.machine.device`)
  lasts what its counted operators cost there (roofline + a launch floor per kernel; a trace without them is
  refused: CPU seconds say nothing of a GPU); on a cluster without one, ``flops / (peak · efficiency)`` when
  its FLOPs are known, else its thread CPU seconds × ``compute_scale`` (this machine's calibrated FLOP/s
  over the device's — "here", scale 1, is the one honest use of CPU seconds);
* a :class:`~minipar.machine.trace.Comm` starts when **every member has issued it** (the k-th call of each member on
  the same group is the same collective; a message: when both sides posted it, matched first in first out
  per direction and tag, a rendezvous as NCCL's send/recv) and when the links it needs are free — each rank
  has a link out and a link in, each carrying one transfer at a time (transfers that share one queue); a
  collective takes both links of every member, a message the sender's out and the receiver's in — and lasts
  its α-β time (:func:`minipar.machine.cluster.comm_seconds`: on the intra-node link if its ranks share a
  node, else the inter-node link; or ``comm_time``'s, e.g. :class:`minipar.machine.fidelity.OpLinks`);
* a blocking call holds its rank until the transfer ends; an async call lets the rank compute on until its
  :class:`~minipar.machine.trace.Wait` (never waited for: at the rank's end).

Ranks advance in global time order (always the unblocked rank with the earliest clock), so collectives
become ready in time order and link queues are first come, first served. If no rank can move while some
wait, :class:`Deadlock` names who waits for whom; members that issue different ops as the same call are a
deadlock too (mismatched order).

Per rank: compute, communication **hidden** under its compute, **exposed** (not under compute), and **idle**
(waiting for peers or a busy link, or done early); compute + exposed + idle = step time; ``pieces()``: the
intervals of each, which :func:`minipar.pipeline.gantt.replay_rows` draws. ``step_gaps()``: the step times.

The pipeline simulator (:mod:`minipar.pipeline.simulate`) is this engine playing a schedule's trace
(:func:`minipar.pipeline.schedule_trace.from_schedule`); its links carry any number of messages at once, so
it routes each message through a stand-in rank of its own — a plain replay queues them on one in-link.
The result, and how it is read: :mod:`minipar.machine.replay_result`.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from minipar.machine.cluster import Cluster, comm_seconds
from minipar.machine.device import ops_of, ops_seconds
from minipar.machine.replay_result import ReplayResult, Span
from minipar.machine.trace import Comm, Compute, Mark, Trace, Wait

__all__ = ["Span", "ReplayResult", "Deadlock", "WaitedCall", "replay", "device_scale"]


@dataclass(frozen=True)
class WaitedCall:
    """The call a blocked rank waits for, as data: ``kind`` "p2p" (a message ``members`` = (src, dst), with its
    ``tag``) or "group" (a collective over ``members``); ``number``: the how-many-th such call it is."""
    kind: str
    members: tuple
    number: int
    tag: object = None


class Deadlock(RuntimeError):
    """No rank can move: ``waits`` maps each blocked rank to (what it waits for, the ranks that never came),
    ``calls`` each blocked rank to the :class:`WaitedCall` it waits for (what a caller reads; the message is
    for people)."""

    def __init__(self, message: str, waits: dict | None = None, calls: dict | None = None):
        super().__init__(message)
        self.waits = waits or {}
        self.calls = calls or {}


def device_scale(cluster: Cluster, source_flops_per_second: float) -> float:
    """Seconds on ``cluster``'s device per CPU second here: (FLOP/s of a rank here) / (peak · efficiency)."""
    return source_flops_per_second / (cluster.peak_flops * cluster.flops_efficiency)


class _Call:
    """One collective or message as the replay sees it: who issued it, when, and when it ran."""

    def __init__(self, key, number, members):
        self.key, self.number, self.members = key, number, tuple(members)
        self.issued: dict = {}           # rank -> (time, Comm, event index)
        self.start = self.end = None

    def waited(self) -> WaitedCall:
        return WaitedCall(self.key[0], self.members, self.number, self.key[3] if self.key[0] == "p2p" else None)

    def describe(self) -> str:
        kind = self.key[0]
        if kind == "p2p":
            tag = "" if self.key[3] is None else f" tag {self.key[3]}"
            return f"message #{self.number}{tag} from rank {self.key[1]} to rank {self.key[2]}"
        ops = sorted({c.op for _, c, _ in self.issued.values()})
        return f"{'/'.join(ops)} #{self.number} on ranks {self.members}"


def _call_key(rank: int, event: Comm) -> tuple:
    if event.op in ("send", "recv"):
        peers = [r for r in event.ranks if r != rank]
        if len(peers) != 1:
            raise ValueError(f"rank {rank}: a {event.op} needs one peer, its ranks are {event.ranks}")
        src, dst = (rank, peers[0]) if event.op == "send" else (peers[0], rank)
        return ("p2p", src, dst, event.tag)
    return ("group", tuple(sorted(event.ranks)))


def _with_final_waits(events: list) -> list:
    """The events, with a Wait at the end for every async call never waited for."""
    return list(events) + [Wait(i) for i, e in enumerate(events)
                           if isinstance(e, Comm) and e.async_ and e.waited_at is None]


def replay(trace: Trace, cluster: Cluster, *, compute_scale: float | None = None,
           source_flops_per_second: float | None = None, comm_time=comm_seconds) -> ReplayResult:
    """Play ``trace`` on ``cluster``. Compute seconds: ``flops / (peak · efficiency)`` where known, else CPU
    seconds × ``compute_scale`` (given, or from ``source_flops_per_second`` / ``trace.meta
    ["flops_per_second"]``: this machine's calibrated FLOP/s per rank). A call lasts ``comm_time(op, ranks,
    payload, cluster)`` seconds."""
    world = trace.world_size
    if world > cluster.devices:
        raise ValueError(f"the trace has {world} ranks, the cluster {cluster.devices} devices")
    if [r.rank for r in trace.ranks] != list(range(world)):
        raise ValueError(f"the trace's ranks must be 0..{world - 1} in order, got {[r.rank for r in trace.ranks]}")
    if cluster.device is not None:
        bare = [r.rank for r in trace.ranks if any(isinstance(e, Compute) and e.ops is None for e in r.events)]
        if bare:
            raise ValueError(f"a replay on a device card ({cluster.device.name}) prices each compute segment's "
                             f"operators; ranks {bare} have segments without them: trace with ops=True")
        compute_scale = 1.0
    if compute_scale is None:
        source = source_flops_per_second or trace.meta.get("flops_per_second")
        needs = any(isinstance(e, Compute) and e.flops is None for r in trace.ranks for e in r.events)
        if source is None and needs:
            raise ValueError("compute without FLOPs needs compute_scale= or source_flops_per_second= (this "
                             "machine's calibrated FLOP/s per rank), or trace.meta['flops_per_second']")
        compute_scale = device_scale(cluster, source) if source else 1.0
    return _Engine(trace, cluster, compute_scale, comm_time).run()


class _Engine:
    def __init__(self, trace, cluster, scale, comm_time=comm_seconds):
        self.cluster, self.scale, self.comm_time = cluster, scale, comm_time
        self.events = [_with_final_waits(r.events) for r in trace.ranks]
        n = len(self.events)
        self.clock, self.pos = [0.0] * n, [0] * n
        self.link_free: dict = {}                 # (rank, "out" | "in") -> when that link is free
        self.blocked: list = [None] * n           # the _Call a rank waits for
        self.mine: list = [dict() for _ in range(n)]   # event index -> _Call, per rank
        self.counts: dict = {}                    # (rank, key) -> calls issued so far
        self.calls: dict = {}                     # (key, number) -> _Call
        self.timelines: list = [[] for _ in range(n)]
        self.done_calls: list = []
        self.marks: list = [[] for _ in range(n)]
        self.priced: dict = {}                    # id(a Compute's ops) -> seconds on the card

    def ready(self, rank) -> bool:
        return self.blocked[rank] is None and self.pos[rank] < len(self.events[rank])

    def run(self) -> ReplayResult:
        # Always step the ready rank with the earliest clock (ties: the lowest rank). A heap of (clock, rank)
        # holds an entry for every ready rank; entries gone stale (the rank moved on or blocked) are skipped.
        self.heap = [(0.0, r) for r in range(len(self.events)) if self.ready(r)]
        while self.heap:
            clock, rank = heapq.heappop(self.heap)
            if clock != self.clock[rank] or not self.ready(rank):
                continue
            index = self.pos[rank]
            self.pos[rank] += 1
            self.step(rank, index, self.events[rank][index])
            if self.ready(rank):
                heapq.heappush(self.heap, (self.clock[rank], rank))
        if any(b is not None for b in self.blocked):
            raise self.deadlock()
        for spans in self.timelines:
            spans.sort(key=lambda s: (s.start, s.end))
        return ReplayResult(self.timelines, list(self.clock), self.cluster, self.done_calls, self.marks)

    def step(self, rank, index, event):
        if isinstance(event, Compute):
            if self.cluster.device is not None:       # priced once per list of rows (segments may share one)
                key = id(event.ops)
                if key not in self.priced:
                    self.priced[key] = ops_seconds(ops_of(event.ops), self.cluster.device)
                seconds = self.priced[key]
            elif event.flops is not None:
                seconds = event.flops / (self.cluster.peak_flops * self.cluster.flops_efficiency)
            else:
                seconds = event.seconds_cpu * self.scale
            start = self.clock[rank]
            self.clock[rank] = start + seconds
            self.timelines[rank].append(Span(rank, "compute", start, start + seconds, index))
        elif isinstance(event, Comm):
            call = self.issue(rank, index, event)
            if not event.async_:
                self.wait_for(rank, call)
        elif isinstance(event, Wait):
            self.wait_for(rank, self.mine[rank][event.comm])
        elif isinstance(event, Mark):
            self.marks[rank].append((event.label, self.clock[rank]))
        else:
            raise ValueError(f"rank {rank}: unknown event {event!r}")

    def issue(self, rank, index, event) -> _Call:
        key = _call_key(rank, event)
        number = self.counts.get((rank, key), 0)
        self.counts[(rank, key)] = number + 1
        members = key[1:3] if key[0] == "p2p" else key[1]
        if rank not in members:
            raise ValueError(f"rank {rank} issued {event.op} on ranks {event.ranks}, which do not include it")
        call = self.calls.setdefault((key, number), _Call(key, number, members))
        for other, (_, theirs, _) in call.issued.items():
            same = theirs.op == event.op if key[0] == "group" else {theirs.op, event.op} == {"send", "recv"}
            if not same:
                raise Deadlock(f"mismatched calls: {call.describe()} — rank {other} issued {theirs.op}, rank "
                               f"{rank} issued {event.op} (the members call in different orders)",
                               {rank: (call.describe(), [other])}, {rank: call.waited()})
        call.issued[rank] = (self.clock[rank], event, index)
        self.mine[rank][index] = call
        if len(call.issued) == len(call.members):
            self.resolve(call)
        return call

    def resolve(self, call: _Call):
        op = "send" if call.key[0] == "p2p" else next(iter(call.issued.values()))[1].op
        payload = max(c.bytes for _, c, _ in call.issued.values())
        links = [(call.key[1], "out"), (call.key[2], "in")] if call.key[0] == "p2p" else \
            [(m, side) for m in call.members for side in ("out", "in")]
        start = max([t for t, _, _ in call.issued.values()] + [self.link_free.get(x, 0.0) for x in links])
        call.start, call.end = start, start + self.comm_time(op, call.members, payload, self.cluster)
        self.done_calls.append((op, call.members, call.start, call.end))
        for x in links:
            self.link_free[x] = call.end
        for m in call.members:
            _, event, index = call.issued[m]
            self.timelines[m].append(Span(m, event.op, call.start, call.end, index))
            if self.blocked[m] is call:
                self.blocked[m] = None
                self.clock[m] = max(self.clock[m], call.end)
                if self.ready(m):
                    heapq.heappush(self.heap, (self.clock[m], m))

    def wait_for(self, rank, call: _Call):
        if call.end is not None:
            self.clock[rank] = max(self.clock[rank], call.end)
        else:
            self.blocked[rank] = call

    def deadlock(self) -> Deadlock:
        waits, calls, lines = {}, {}, []
        for rank, call in enumerate(self.blocked):
            if call is None:
                continue
            missing = [m for m in call.members if m not in call.issued]
            waits[rank], calls[rank] = (call.describe(), missing), call.waited()
            why = []
            for m in missing:
                other = self.blocked[m]
                why.append(f"rank {m} " + (f"waits for {other.describe()}" if other is not None
                                           else "never issues it (its trace ended)"))
            lines.append(f"rank {rank} waits for {call.describe()}: " + "; ".join(why))
        return Deadlock("deadlock: " + " | ".join(lines), waits, calls)

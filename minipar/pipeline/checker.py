"""Check a schedule before it runs: every message has its two ends, and playing it cannot hang.

A schedule is data (each rank's action list), so the messages it implies can be listed and played without
processes. They are read from the one lowering of a schedule into messages,
:func:`minipar.pipeline.lowering.lower` (the runtime reads the same): each action receives the inputs it waits
for from other ranks and sends what it produced for them; a neighbour on the *same* rank (the turn of a V)
is a local hand-over: no message, but the producing action must come earlier in the rank's own list.

Semantics played (those of :mod:`minipar.pipeline.runtime`, and of a ``batch_isend_irecv`` per action):
a send is posted and never blocks; a receive blocks until its message has been sent. With ``order="fifo"``
messages between two ranks also match in the order they were sent (NCCL has no tags): a receive that finds
another message at the head of its queue is a mismatch. The play is a fixed point: every rank advances while
it can; if some cannot and none can, the first blocked rank and its action are named, with what they wait for
(a rank that waits for its own later action first: it is the cause; then the lowest rank). Checked
besides: each stage does F and (B and W, or BW) of every micro-batch exactly once,
on the rank that holds it, with W after its B and the backward after its forward.
"""
from __future__ import annotations

from collections import deque

from .actions import Action, Schedule, made
from .lowering import Recv, Send, lower

__all__ = ["ScheduleError", "check"]


class ScheduleError(ValueError):
    """The schedule is wrong: a missing or duplicated action, an unmatched message, or a deadlock. For a
    deadlock, ``rank``, ``index`` and ``action`` say which rank waits forever at which of its actions."""

    def __init__(self, message: str, rank: int | None = None, index: int | None = None, action=None):
        super().__init__(message)
        self.rank, self.index, self.action = rank, index, action


def _local_needs(a: Action, last: int) -> list:
    """(kind, stage, mb) that must be done before ``a``, wherever they run (B stands for BW too)."""
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if a.kind in ("B", "BW"):
        return [("F", s, i)] + ([("B", s + 1, i)] if s < last else [])
    return [("B", s, i)]


def _per_action(lowered_rank: list) -> list:
    """One rank's lowered list regrouped by action: [(receives, sends)] per action, as lists of Message."""
    grouped, recv = [], []
    for x in lowered_rank:
        if isinstance(x, Recv):
            recv.append(x.message)
        elif isinstance(x, Send):
            grouped[-1][1].append(x.message)
        else:
            grouped.append((recv, []))
            recv = []
    return grouped


def _check_complete(schedule: Schedule) -> None:
    """Every stage: F and (B + W or BW) of each micro-batch exactly once, on its own rank."""
    for r, acts in enumerate(schedule.actions):
        seen = set()
        for k, a in enumerate(acts):
            if schedule.rank_of(a.stage) != r:
                raise ScheduleError(f"rank {r} action {k} ({a}): stage {a.stage} is held by rank "
                                    f"{schedule.rank_of(a.stage)}")
            if (a.kind, a.stage, a.microbatch) in seen:
                raise ScheduleError(f"rank {r} action {k} ({a}) appears twice")
            seen.add((a.kind, a.stage, a.microbatch))
        for s in schedule.stages_of(r):
            for i in range(schedule.m):
                split = ("B", s, i) in seen or ("W", s, i) in seen
                need = ("F", "B", "W") if split else ("F", "BW")
                for kind in need:
                    if (kind, s, i) not in seen:
                        raise ScheduleError(f"rank {r} never runs {kind}{i}@{s}")
                if split and ("BW", s, i) in seen:
                    raise ScheduleError(f"rank {r} runs both BW{i}@{s} and B/W{i}@{s}")


def check(schedule: Schedule, order: str = "tag") -> int:
    """Raise :class:`ScheduleError` naming the first problem; return the number of p2p messages per step.
    ``order="tag"``: messages match by (what, stage, micro-batch), as minipar's runtime tags them;
    ``order="fifo"``: between two ranks they must also be received in the order they were sent."""
    if order not in ("tag", "fifo"):
        raise ValueError(f"order must be 'tag' or 'fifo', got {order!r}")
    _check_complete(schedule)
    p, last = schedule.p, schedule.num_stages - 1
    moves = [_per_action(steps) for steps in lower(schedule)]   # moves[r][k]: (receives, sends) of action k
    pos, done = [0] * p, set()
    posted = {}                                              # (src, dst) -> deque of messages in flight
    sent = received = 0
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(schedule.actions[r]):
                a = schedule.actions[r][pos[r]]
                if _blocked(schedule, r, a, moves[r][pos[r]][0], done, posted, order, last) is not None:
                    break
                recv, send = moves[r][pos[r]]
                for msg in recv:
                    posted[(msg.src, msg.dst)].remove(msg)
                    received += 1
                for msg in send:
                    posted.setdefault((msg.src, msg.dst), deque()).append(msg)
                    sent += 1
                done.add(made(a))
                pos[r] += 1
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(schedule.actions[r])]
    # a rank that waits for its own later action is the cause; the others wait for it
    def why(q):
        return _blocked(schedule, q, schedule.actions[q][pos[q]], moves[q][pos[q]][0], done, posted, order, last)
    stuck.sort(key=lambda q: (f"rank {q} has not run" not in why(q), q))
    if stuck:
        r = stuck[0]
        a = schedule.actions[r][pos[r]]
        others = ", ".join(f"rank {q} at {schedule.actions[q][pos[q]]}" for q in stuck[1:])
        raise ScheduleError(f"deadlock: rank {r} waits forever at action {pos[r]} ({a}): {why(r)}"
                            + (f"; blocked too: {others}" if others else ""), r, pos[r], a)
    left = [str(m) for q in posted.values() for m in q]
    if left:
        raise ScheduleError(f"sent but never received: {', '.join(left)}")
    assert sent == received
    return sent


def _blocked(schedule, r, a, receives, done, posted, order, last):
    """Why action ``a`` on rank r, which ``receives`` these messages, cannot start yet (None: it can)."""
    for kind, s, i in _local_needs(a, last):
        if (kind, s, i) not in done and (schedule.rank_of(s) == r or kind == "F" and s == a.stage):
            return f"it needs {kind}{i}@{s}, which rank {r} has not run before it"
    for msg in receives:
        queue = posted.get((msg.src, msg.dst), ())
        if msg not in queue:
            return f"it receives {msg}, never sent before"
        if order == "fifo" and queue[0] != msg:
            return f"it receives {msg} but rank {msg.src} sent {queue[0]} first (FIFO order)"
    return None

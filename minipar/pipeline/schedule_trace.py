"""The trace a pipeline runtime would leave running a schedule: the schedule written in the measurement wing's
format (:mod:`minipar.machine.trace`), so that the one replay engine (:mod:`minipar.machine.replay`) plays
it — the pipeline simulator (:mod:`minipar.pipeline.simulate`) is that replay.

The messages are the lowering's (:func:`minipar.pipeline.lowering.lower`), placed as the runtime places
them: every receive posted at the start (async) and waited for right before the action that needs it, every
result sent (async) to the rank that needs it as soon as it is computed, each message tagged with the action
it feeds; an F&B pair of DualPipeV (``Schedule.overlapped``) waits for both inputs before either computes.
"""
from __future__ import annotations

from ..machine.trace import Comm, Compute, RankTrace, Trace, Wait
from .actions import Action, Schedule
from .lowering import Recv, Send, lower

__all__ = ["from_schedule", "from_lowered", "consumers"]


def consumers(lowered: list) -> dict:
    """{Message: the action that waits for it}: the action each :class:`Recv` of the lowered lists precedes."""
    fed, waiting = {}, []
    for steps in lowered:
        for x in steps:
            if isinstance(x, Recv):
                waiting.append(x.message)
            elif isinstance(x, Action):
                fed.update((msg, x) for msg in waiting)
                waiting = []
    return fed


def from_schedule(schedule: Schedule, costs, message_bytes: int = 0) -> Trace:
    """The trace of ``schedule`` with compute costed by ``costs`` (``costs.of(kind, v)`` seconds, as
    :class:`minipar.pipeline.simulate.Costs`) and ``message_bytes`` per message. Its replay with links of
    α = ``costs.p2p`` is the pipeline simulator's timeline (tests/test_replay.py)."""
    return from_lowered(schedule, lower(schedule), costs, message_bytes)


def from_lowered(schedule: Schedule, lowered: list, costs, message_bytes: int = 0, *, fed: dict | None = None) -> Trace:
    """:func:`from_schedule` of a schedule already lowered (``lowered = lower(schedule)``); ``fed``:
    ``consumers(lowered)`` if the caller has it already."""
    fed = consumers(lowered) if fed is None else fed
    return Trace([RankTrace(r, _rank_events(schedule, r, steps, fed, costs, message_bytes))
                  for r, steps in enumerate(lowered)],
                 {"schedule": schedule.name, "p": schedule.p, "m": schedule.m, "v": schedule.v})


def _rank_events(schedule: Schedule, r: int, steps: list, fed: dict, costs, message_bytes: int) -> list:
    """Rank r's events: its receives posted up front, then per action (or F&B pair) the waits for its inputs,
    its compute and its sends."""
    events, posted = [], {}                          # posted: action -> index of its receive
    for x in steps:
        if isinstance(x, Recv):
            posted[fed[x.message]] = len(events)
            events.append(Comm("recv", tuple(sorted((r, x.message.src))), message_bytes, True,
                               tag=str(fed[x.message])))
    done = []                                        # [(action, its sends)] in order
    for x in steps:
        if isinstance(x, Action):
            done.append((x, []))
        elif isinstance(x, Send):
            done[-1][1].append(x.message)
    blocks, i = [], 0                                # one action, or an F&B pair
    while i < len(done):
        n = 2 if (r, i) in schedule.overlapped else 1
        blocks.append(done[i:i + n])
        i += n
    for block in blocks:
        for a, _ in block:
            if a in posted:
                events.append(Wait(posted[a]))
                events[posted[a]].waited_at = len(events) - 1
        for a, sends in block:
            events.append(Compute(costs.of(a.kind, schedule.v)))
            events += [Comm("send", tuple(sorted((r, m.dst))), message_bytes, True, tag=str(fed[m]))
                       for m in sends if m in fed]           # (no action left to receive it: not sent)
    return events

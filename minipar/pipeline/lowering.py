"""Lower a schedule's compute-only action lists into lists with their messages: the one place where a
pipeline's point-to-point traffic is derived. The runtime (:mod:`minipar.pipeline.runtime`), the checker
(:mod:`minipar.pipeline.checker`), the schedule-made trace (:mod:`minipar.pipeline.schedule_trace`) and through
it the simulator (:mod:`minipar.pipeline.simulate`) all read it. PyTorch does the same once for all its
schedules (``torch.distributed.pipelining.schedules._add_send_recv``: compute-only lists in, lists with
``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B`` out).

For action ``a`` on rank r, stage s held by ``schedule.rank_of(s)`` (:mod:`minipar.pipeline.actions`):

* ``F`` of (s, i) receives the activation entering (s, i) from the rank of s-1 (s > 0) and sends the
  activation entering (s+1, i) to the rank of s+1 (s < last);
* ``B`` / ``BW`` of (s, i) receives the gradient of (s, i)'s output from the rank of s+1 (s < last) and sends
  the gradient of its input — the output gradient of s-1 — to the rank of s-1 (s > 0); ``W`` moves nothing;
* a neighbour stage on the *same* rank (the turn of a V) is a local hand-over: no message.

The lowered list of a rank is its actions in order, each preceded by the :class:`Recv` of the input it waits
for and followed by the :class:`Send` of what it produced for another rank (``[Recv, F, Send, Recv, BW, …]``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .actions import Action, Schedule

__all__ = ["Message", "Send", "Recv", "messages_of", "lower", "rank_messages"]


@dataclass(frozen=True)
class Message:
    """``what`` ("act" / "grad") of (``stage``, ``microbatch``) going pipeline rank ``src`` → ``dst``: the
    activation entering ``stage``, or the gradient of ``stage``'s output."""
    what: str
    stage: int
    microbatch: int
    src: int
    dst: int

    def tag(self, m: int) -> int:
        """Unique per message of a step of ``m`` micro-batches: 2·(b·m + i) + (1 for a gradient), b the upper
        stage of the boundary it crosses (the stage an activation enters, the stage a gradient leaves)."""
        boundary = self.stage if self.what == "act" else self.stage + 1
        return 2 * (boundary * m + self.microbatch) + (self.what == "grad")

    def __str__(self) -> str:
        return f"{self.what}({self.stage},{self.microbatch}) {self.src}→{self.dst}"


@dataclass(slots=True)
class Send:
    """Post ``message`` (its sender's side)."""
    message: Message

    def __str__(self) -> str:
        return f"send {self.message}"


@dataclass(slots=True)
class Recv:
    """Receive ``message`` (its receiver's side), before the action that needs it."""
    message: Message

    def __str__(self) -> str:
        return f"recv {self.message}"


def messages_of(schedule: Schedule, rank: int, a: Action) -> tuple:
    """(receives, sends) of action ``a`` on ``rank``: lists of :class:`Message`."""
    last, s, i = schedule.num_stages - 1, a.stage, a.microbatch
    recv, send = [], []
    if a.kind == "F":
        if s > 0 and schedule.rank_of(s - 1) != rank:
            recv.append(Message("act", s, i, schedule.rank_of(s - 1), rank))
        if s < last and schedule.rank_of(s + 1) != rank:
            send.append(Message("act", s + 1, i, rank, schedule.rank_of(s + 1)))
    elif a.kind in ("B", "BW"):
        if s < last and schedule.rank_of(s + 1) != rank:
            recv.append(Message("grad", s, i, schedule.rank_of(s + 1), rank))
        if s > 0 and schedule.rank_of(s - 1) != rank:
            send.append(Message("grad", s - 1, i, rank, schedule.rank_of(s - 1)))
    return recv, send


def lower(schedule: Schedule) -> list:
    """Per rank, its actions with their messages: ``[Recv…, action, Send…]`` for every action in order."""
    lowered = []
    for r, actions in enumerate(schedule.actions):
        steps = []
        for a in actions:
            recv, send = messages_of(schedule, r, a)
            steps += [Recv(m) for m in recv] + [a] + [Send(m) for m in send]
        lowered.append(steps)
    return lowered


def rank_messages(lowered_rank: list) -> tuple:
    """({(what, stage, micro-batch): Message} received, the same sent) of one rank's lowered list: what the
    runtime looks its peers and tags up in (a stage missing from both is a local hand-over)."""
    received = {(x.message.what, x.message.stage, x.message.microbatch): x.message
                for x in lowered_rank if isinstance(x, Recv)}
    sent = {(x.message.what, x.message.stage, x.message.microbatch): x.message
            for x in lowered_rank if isinstance(x, Send)}
    return received, sent

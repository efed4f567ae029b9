"""What a ring all-reduce sends, message by message: a hook that keeps every send's tensor, and the
communication log of one rank.

A hook (:mod:`minipar.hooks`) sees every call through :mod:`minipar.comm`; this one keeps what each send
carries, so that the chapter can print the 2(N−1) steps of a ring all-reduce and hold every message to the
rule worked out on one process (:func:`.tour.expected_ring_messages`).
"""
from __future__ import annotations

import torch

from minipar import comm, hooks
from minipar.launcher import launch

__all__ = ["SentMessages", "ring_steps", "ring_log"]


class SentMessages:
    """A hook: every call through minipar.comm passes it; it keeps what each send carries."""

    def __init__(self):
        self.messages = []

    def around_call(self, call, proceed):
        if call.op == "send":
            self.messages.append(call.tensor.reshape(-1).tolist())
        return proceed()


def _sent_on_rank(rank, world_size):
    x = 10.0 * rank + torch.arange(1, 2 * world_size + 1)     # rank r holds 10·r + 1, ..., 2N: N chunks of 2
    with hooks.installed(SentMessages()) as listener:
        comm.ring_all_reduce(x)
    return listener.messages


def ring_steps(world_size: int = 4) -> list:
    """[rank][k]: the values rank sent in message k of one ring all-reduce of the small inputs."""
    return launch(_sent_on_rank, world_size, quiet=True)


def _log_on_rank(rank, world_size, numel):
    with comm.recording() as log:
        comm.ring_all_reduce(torch.ones(numel))
    return [(rec.op, rec.sent_bytes, rec.recv_bytes) for rec in log.records]


def ring_log(payload_bytes: int = 4096, world_size: int = 4) -> list:
    """Rank 0's communication log of one ring all-reduce of ``payload_bytes``: [(op, bytes sent, received)]."""
    return launch(_log_on_rank, world_size, payload_bytes // 4, quiet=True)[0]

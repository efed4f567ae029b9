"""Healing: a replica that (re)joins receives a live peer's state over the quorum's process group.

The source's local rank i sends its counterpart in the healing replica what that rank holds — its stages'
parameters and its optimizer's state (Adam's moments and step counts), with the number of committed steps — as
one ``torch.save`` buffer: its length, then the bytes (two point-to-point messages over the quorum's gloo group,
as torchft's recovery sends a ``state_dict`` over its process group). Nothing is read from disk. The healing
replica loads it only once every one of its ranks has received its part (:func:`replica_agrees`): a source that
dies mid-stream leaves the healer as it was, and the next round heals it again. Parameters copied bit for bit and
the same optimizer state make the healed replica's next step identical to its source's.
"""
from __future__ import annotations

import io
import time

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["state_of", "send_state", "receive_state", "load_state", "exchange", "replica_agrees"]

TAG = 7


def state_of(trainer, committed: int) -> bytes:
    """This rank's share of the replica's state, serialized: parameters, optimizer state, committed steps."""
    buf = io.BytesIO()
    torch.save({"params": [p.detach().cpu() for p in trainer.params],
                "optimizer": trainer.optimizer.state_dict(), "step": committed}, buf)
    return buf.getvalue()


def send_state(group, dst: int, payload: bytes) -> None:
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, TAG).wait()
    group.send([data], dst, TAG + 1).wait()


def receive_state(group, src: int) -> tuple:
    """(the state, its size in bytes on the wire)."""
    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], src, TAG).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    group.recv([data], src, TAG + 1).wait()
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False), data.numel()


def load_state(trainer, state: dict) -> int:
    """Copy a received state into this rank's trainer; returns the committed steps it carries."""
    with torch.no_grad():
        for p, value in zip(trainer.params, state["params"], strict=True):
            p.copy_(value)
    trainer.optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def exchange(trainer, client, quorum, committed: int) -> tuple:
    """The round's healing on this rank: a source sends to each replica it heals; a healer receives.
    Returns (the state received or None, seconds spent); ``client.healed_bytes`` counts what it received."""
    t0, received = time.perf_counter(), None
    me = client.replica
    for healer, source in sorted(quorum.heal.items()):
        if source == me:
            send_state(client.group, quorum.index(healer), state_of(trainer, committed))
    if me in quorum.heal:
        received, nbytes = receive_state(client.group, quorum.index(quorum.heal[me]))
        client.healed_bytes += nbytes
    return received, time.perf_counter() - t0


def replica_agrees(ok: bool, world_size: int) -> bool:
    """Whether every rank of this replica says ``ok`` (a MIN all-reduce over the replica's own group)."""
    if world_size == 1:
        return ok
    flag = torch.tensor([int(ok)])
    comm.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())

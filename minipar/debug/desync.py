"""A desync check: before each collective, the ranks of its group compare what they are about to call.

A collective is matched by position: the k-th call of every member of a group is one collective. When one
rank's program differs (a skipped call, another op, another shape or dtype) gloo or NCCL either hangs, or
fails with a message from deep inside the library, or — worst — reduces buffers of different sizes without a
word. Inside :func:`desync_check` every :mod:`minipar.comm` collective first all-gathers a small fingerprint
over its group: a fixed-size int64 tensor holding the call's number on that group, the op, the dtype and the
shape. If the fingerprints differ, **every** rank raises the same ``ValueError`` before the real call, naming
each side::

    desync at call #3 on ranks [0, 1]: all_reduce: rank 0 float32[4] vs rank 1 float32[8]

It costs one small all-gather per collective (a latency α each), which is why it is opt-in. Sends and receives
are not checked (a message has two ends, not a group; the flight recorder matches them after the fact).

Sources: PyTorch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does the same for every collective of a process group
(torch/csrc/distributed/c10d/ProcessGroupWrapper.cpp: a ``CollectiveFingerPrint`` — sequence number, op type,
shapes, dtypes, devices — all-gathered over a helper gloo group before each call, "Detected mismatch between
collectives on ranks"); it is switched on by an environment variable read when the group is created.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import hooks

__all__ = ["desync_check", "DesyncCheck", "fingerprint", "describe", "MAX_DIMS"]

MAX_DIMS = 8                     # shapes of more dimensions are compared by their first 8 and their size
_OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "scatter", "gather", "reduce"]
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool]
_SHAPES_MAY_DIFFER = {"all_to_all"}   # uneven splits are legitimate (as in minipar.flight)


def fingerprint(k: int, op: str, tensor) -> torch.Tensor:
    """The int64 tensor a rank sends: [k, op, dtype, ndim, numel, dim_0 .. dim_7] (-1: unknown or absent)."""
    out = torch.full((5 + MAX_DIMS,), -1, dtype=torch.int64)
    out[0], out[1] = k, _OPS.index(op) if op in _OPS else len(_OPS)
    if tensor is not None:
        out[2] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
        out[3], out[4] = tensor.dim(), tensor.numel()
        if op not in _SHAPES_MAY_DIFFER:
            dims = list(tensor.shape)[:MAX_DIMS]
            out[5:5 + len(dims)] = torch.tensor(dims, dtype=torch.int64)
        else:
            out[4] = -1
    return out


def _what(f: torch.Tensor, with_op: bool) -> str:
    f = f.tolist()
    op = _OPS[f[1]] if f[1] < len(_OPS) else "?"
    dtype = str(_DTYPES[f[2]])[6:] if 0 <= f[2] < len(_DTYPES) else "?"
    shape = ", ".join(str(d) for d in f[5:5 + min(f[3], MAX_DIMS)])
    tensor = f"{dtype}[{shape}]" if f[4] >= 0 else f"{dtype}[...]"
    return f"{op} {tensor}" if with_op else tensor


def describe(fingerprints: list, ranks: list, k: int) -> str | None:
    """The error text for one call's gathered fingerprints (None when they all agree)."""
    sides = {}
    for rank, f in zip(ranks, fingerprints):
        sides.setdefault(tuple(f.tolist()), []).append(rank)
    if len(sides) == 1:
        return None
    ops = {key[1] for key in sides}
    calls = {key[0] for key in sides}
    text = f"desync at call #{k} on ranks {list(ranks)}: "
    if len(calls) > 1:                              # one rank skipped (or added) a call on this group
        text = f"desync on ranks {list(ranks)}: the ranks are at different calls: "
    named = []
    for key, members in sides.items():
        who = ("rank " if len(members) == 1 else "ranks ") + ", ".join(map(str, members))
        call = f"call #{key[0]} " if len(calls) > 1 else ""
        named.append(f"{who} {call}{_what(torch.tensor(key), with_op=len(ops) > 1 or len(calls) > 1)}")
    if len(ops) == 1 and len(calls) == 1:
        op = next(iter(ops))
        text += f"{_OPS[op] if op < len(_OPS) else '?'}: "
    return text + " vs ".join(named)


class DesyncCheck:
    """One active check (a hook, :mod:`minipar.hooks`): counts this rank's calls per group; ``calls`` how many
    it has compared."""

    def __init__(self, group=None):
        self.only, self.calls_on, self.calls = group, {}, 0

    def around_call(self, call, proceed):
        """Compare the call across its group first (a collective); raise on a difference, else run it."""
        self.check(call.op, call.group, call.peer, call.tensor)
        return proceed()

    def check(self, op, group, peer, tensor) -> None:
        if peer is not None or (self.only is not None and group is not self.only):
            return                                  # a send/recv, or another group than the one watched
        pg = dist.group.WORLD if group is None else group
        ranks = list(range(dist.get_world_size())) if pg is dist.group.WORLD else dist.get_process_group_ranks(pg)
        key = id(pg)
        k = self.calls_on[key] = self.calls_on.get(key, 0) + 1
        mine = fingerprint(k, op, tensor)
        everyone = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(everyone, mine, group=group)    # torch.distributed itself: not a call of minipar.comm
        self.calls += 1
        problem = describe(everyone, ranks, k)
        if problem:
            raise ValueError(problem)


@contextlib.contextmanager
def desync_check(group=None):
    """Inside this block every :mod:`minipar.comm` collective (on ``group`` only, if given) is compared across
    its group before it runs, and a difference raises ``ValueError`` on every member. Yields the
    :class:`DesyncCheck` (its ``calls``: how many calls it compared)."""
    with hooks.installed(DesyncCheck(group)) as check:
        yield check

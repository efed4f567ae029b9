"""Gradient buckets: many small gradients packed into one flat buffer, reduced as one message.

Sending one message per parameter pays the link's latency α once per tensor; a bucket of about
``bucket_bytes`` pays it once per bucket, and a bucket that fills up early in backward can be reduced while
backward goes on (Li et al. 2020, §3.2.3). Used by :mod:`minipar.data.ddp` (all-reduce per bucket) and by the
sharded strategies that reuse its :class:`~minipar.data.ddp.Reducer` with another collective.
"""
from __future__ import annotations

import torch

from ..flat import FlatLayout

__all__ = ["assign_buckets", "Bucket"]


def assign_buckets(params: list, bucket_bytes: int, element_size: int | None = None) -> list:
    """Split ``params`` (already in the order their gradients are expected) into consecutive groups; a
    group is closed as soon as it holds ``bucket_bytes`` or more (as PyTorch does), so every bucket but
    the last is at least ``bucket_bytes`` and the last one, the only one whose all-reduce nothing can
    hide (it is launched when backward is over), is the remainder."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * (element_size or p.element_size())
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class Bucket:
    """A flat buffer for some parameters' gradients, reduced as one message.

    ``buffer`` is in ``comm_dtype`` (the parameters' dtype by default): gradients are cast into it, sent,
    and cast back, so a 16-bit ``comm_dtype`` halves the bytes on the wire."""

    def __init__(self, index: int, params: list, comm_dtype: torch.dtype | None = None):
        self.index, self.params = index, list(params)
        dtype = comm_dtype or self.params[0].dtype
        self.layout = FlatLayout([p.shape for p in self.params])              # unpadded: one part
        self.buffer = torch.zeros(self.layout.numel, dtype=dtype, device=self.params[0].device)
        self.views = self.layout.views(self.buffer)                           # slot i, of parameter i's shape
        self.slot = {id(p): i for i, p in enumerate(self.params)}
        self.filled: set = set()
        self.work = None

    def fill(self, param) -> bool:
        """Copy ``param.grad`` into its slot; return True when every slot is filled."""
        i = self.slot[id(param)]
        self.views[i].copy_(param.grad)
        self.filled.add(i)
        return self.is_full

    @property
    def is_full(self) -> bool:
        return len(self.filled) == len(self.params)

    def fill_missing(self) -> list:
        """Slots whose parameter produced no gradient in this backward: its existing ``.grad`` (left by an
        earlier ``no_sync`` backward) or zeros. Returns the parameters that had no gradient at all."""
        absent = []
        for i, p in enumerate(self.params):
            if i in self.filled:
                continue
            if p.grad is not None:
                self.views[i].copy_(p.grad)
            else:
                self.views[i].zero_()
                absent.append(p)
            self.filled.add(i)
        return absent

    def copy_out(self) -> None:
        """Write the reduced buffer back into every parameter's ``.grad``."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(self.views[i])

    def reset(self) -> None:
        self.filled.clear()
        self.work = None

"""Many tensors as one flat buffer, padded to equal shards: the one layout every flat buffer in minipar uses.

ZeRO's and FSDP's units (:mod:`minipar.data.flat_unit`), the sharded optimizer, the parameter server, DDP's
gradient buckets, HSDP's hierarchical all-reduce, per-parameter FSDP's staging buffers, ZeRO++'s int8 blocks and
:func:`minipar.comm.all_reduce_flat` / :func:`minipar.comm.ring_all_reduce` all lay their tensors out so::

    tensor i at [offsets[i], offsets[i] + numel_i)     numel = Σ numel_i
    S = ⌈numel / n⌉ = shard_numel, n·S = padded_numel   shard r is [r·S, (r+1)·S); the last carries the padding

(``n = 1``: no padding; :meth:`FlatLayout.in_blocks`: shards of a fixed size, as many as it takes). The
arithmetic alone, no collective: it sits on the ground floor so that :mod:`minipar.comm` can use it too.
"""
from __future__ import annotations

import itertools

import torch

__all__ = ["FlatLayout"]


class FlatLayout:
    """Tensors of ``shapes`` in one flat buffer padded to ``n`` equal shards (``n=1``: no padding)."""

    def __init__(self, shapes, n: int = 1):
        self.shapes = [torch.Size(s) for s in shapes]
        sizes = [s.numel() for s in self.shapes]
        self.offsets = [0, *itertools.accumulate(sizes)][:-1]
        self.n, self.numel = n, sum(sizes)
        self.shard_numel = -(-self.numel // n)                 # S = ceil(numel / N)
        self.padded_numel = self.shard_numel * n               # the last shard carries the padding

    @classmethod
    def in_blocks(cls, shapes, block: int) -> "FlatLayout":
        """Shards of exactly ``block`` elements, ⌈numel / block⌉ of them (a block quantizer's layout)."""
        layout = cls(shapes)
        layout.n = -(-layout.numel // block)
        layout.shard_numel, layout.padded_numel = block, layout.n * block
        return layout

    def flatten(self, tensors) -> torch.Tensor:
        """``tensors`` (one per shape, any dtype they share) concatenated and zero-padded: a new tensor."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        pad = self.padded_numel - self.numel
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def views(self, flat: torch.Tensor) -> list:
        """``flat`` cut into one view per tensor, each of its shape (no copy: writes go through)."""
        return [flat[o: o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def unflatten(self, flat: torch.Tensor, tensors) -> list:
        """Copy ``flat``'s pieces back into ``tensors``, in place (the inverse of :meth:`flatten`)."""
        for t, view in zip(tensors, self.views(flat)):
            t.copy_(view)
        return tensors

    def shard(self, rank: int) -> slice:
        """Rank ``rank``'s elements of the flat buffer."""
        return slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def piece_bounds(self, rank: int) -> list:
        """Each tensor's elements inside ``rank``'s shard, as (start, stop) in shard coordinates (maybe empty):
        the pieces an optimizer steps one by one, with per-parameter state."""
        first, out = rank * self.shard_numel, []
        for offset, shape in zip(self.offsets, self.shapes):
            lo = min(max(offset - first, 0), self.shard_numel)
            hi = min(max(offset + shape.numel() - first, lo), self.shard_numel)
            out.append((lo, hi))
        return out

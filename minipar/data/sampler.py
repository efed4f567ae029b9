"""Which examples each rank sees: a distributed sampler, and the shard of a global batch.

:class:`DistributedSampler` gives rank r of N the indices ``order[r], order[r+N], order[r+2N], ...`` of one
epoch's order (a seeded permutation, re-drawn by :meth:`set_epoch`). Every rank must see the same number
of examples (ranks that run out early would wait forever in the next all-reduce), so a dataset of L
examples becomes ``N · ceil(L/N)`` indices by repeating the first ``N·ceil(L/N) - L`` of the order
(padding), or ``N · floor(L/N)`` by dropping the tail (``drop_last=True``). Padding means a few examples
count twice per epoch: harmless for training, wrong for an exact evaluation metric.

This follows ``torch.utils.data.DistributedSampler`` index for index (same seed, same permutation), so
the two can be swapped; the test checks that.
"""
from __future__ import annotations

import math

import torch


__all__ = ["DistributedSampler"]


class DistributedSampler:
    """Indices of ``dataset`` (anything with a length, or an int) for ``rank`` of ``num_replicas``."""

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        length = dataset if isinstance(dataset, int) else len(dataset)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank={rank}, num_replicas={num_replicas}")
        if drop_last and length < num_replicas:
            raise ValueError(f"drop_last with {length} examples on {num_replicas} ranks leaves none per rank")
        self.length, self.num_replicas, self.rank = length, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        per_rank = length // num_replicas if drop_last else math.ceil(length / num_replicas)
        self.num_samples, self.total_size = per_rank, per_rank * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Call at the start of every epoch: a new shuffle, identical on every rank (same seed + epoch)."""
        self.epoch = epoch

    def epoch_order(self) -> list:
        """The whole epoch's padded (or truncated) order, before it is dealt out to the ranks."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        if self.drop_last:
            return order[: self.total_size]
        padding = self.total_size - len(order)
        while padding > 0:  # repeat from the start (more than once if the dataset is tiny)
            order += order[:padding]
            padding = self.total_size - len(order)
        return order

    def __iter__(self):
        # Dealt like cards: rank r takes every N-th index starting at r.
        return iter(self.epoch_order()[self.rank: self.total_size: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

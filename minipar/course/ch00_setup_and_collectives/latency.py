"""The latency half of the ring's cost, timed: a small all-reduce on N ranks.

A ring all-reduce takes 2(N−1) steps, each a message that must arrive before the next is sent, so its time is
about 2(N−1)·α + 2(N−1)/N·S/β (α: a message's fixed cost, β: bandwidth; Patarasuk & Yuan 2009). For a small S
the α term is almost all there is, and it grows linearly with N while the bytes per rank stay under 2S. On this
machine α is mostly a process waking up on a shared core, not a network; the trend is the lesson, not the
milliseconds.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from minipar import comm

__all__ = ["time_small_ring", "slowest_rank_median", "fit_alpha"]


def time_small_ring(numel: int = 1024, repeats: int = 7) -> list:
    """On each rank, inside a launch: seconds of ``repeats`` ring all-reduces of ``numel`` float32, every
    repeat started together (a barrier), after one warm-up call that opens the connections."""
    x = torch.ones(numel)
    comm.ring_all_reduce(x.clone())
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        comm.ring_all_reduce(x.clone())
        seconds.append(time.perf_counter() - start)
    return seconds


def slowest_rank_median(per_rank_seconds: list) -> float:
    """Median over repeats of the slowest rank's time (a collective is done only when every rank is)."""
    return statistics.median(max(rank[i] for rank in per_rank_seconds) for i in range(len(per_rank_seconds[0])))


def fit_alpha(seconds_by_n: dict) -> float:
    """α from time ≈ 2(N−1)·α, least squares through the origin over the measured N."""
    steps = {n: 2 * (n - 1) for n in seconds_by_n}
    return sum(steps[n] * t for n, t in seconds_by_n.items()) / sum(s * s for s in steps.values())

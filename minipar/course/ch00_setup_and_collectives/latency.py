"""The ring's cost, timed: a small and a larger all-reduce on N ranks, and α and β fitted to them.

A ring all-reduce takes 2(N−1) steps, each a message that must arrive before the next is sent, so its time is
about 2(N−1)·α + 2(N−1)/N·S/β (α: a message's fixed cost, β: bandwidth; Patarasuk & Yuan 2009). For a small S
the α term is almost all there is, and it grows linearly with N while the bytes per rank stay under 2S. On this
machine α is mostly a process waking up to read a local socket, not a network. A second, larger size fixes β, so that α
is fitted in the same form as every later chapter's (:func:`fit_ring`). Only N up to the machine's cores are
fitted (:func:`fitted_ranks`): with more ranks than cores the processes take turns on the cores, and the time
measures that waiting, not the ring's 2(N−1) steps; larger N are shown from the fitted model.
"""
from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

from minipar import comm
from minipar.machine.fidelity import ring_terms

__all__ = ["SMALL_BYTES", "time_small_ring", "slowest_rank_fastest", "sweep_seconds", "machine_cores",
           "fitted_ranks", "fit_ring", "ring_model_seconds", "beta_text"]

SMALL_BYTES = 4096   # the small all-reduce: 1024 float32


def time_small_ring(numel: int = SMALL_BYTES // 4, repeats: int = 7) -> list:
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


def slowest_rank_fastest(per_rank_seconds: list) -> float:
    """The fastest repeat of the slowest rank's time (a collective is done only when every rank is; the fastest
    repeat is the least contended: on shared cores a slower one waited for a core, not for a message — chapter
    05 fits its α and β to the fastest calls too)."""
    return min(max(rank[i] for rank in per_rank_seconds) for i in range(len(per_rank_seconds[0])))


def sweep_seconds(sweep: dict, payload_bytes: int) -> dict:
    """{(N, S bytes): seconds} of a ring-vs-root sweep (``busiest_rank_traffic`` per N): both timed sizes."""
    return {**{(n, SMALL_BYTES): t["small_ring_s"] for n, t in sweep.items()},
            **{(n, payload_bytes): t["ring_s"] for n, t in sweep.items()}}


def machine_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fitted_ranks(world_sizes, cores: int) -> list:
    """The N whose times measure the ring: those with no more ranks than ``cores`` (beyond, a rank waits for a
    core between steps). With none (one core), the smallest N, the least oversubscribed."""
    return sorted(n for n in world_sizes if n <= cores) or [min(world_sizes)]


def ring_model_seconds(n: int, size: int, alpha: float, beta: float) -> float:
    """``2(N−1)·α + 2(N−1)/N·S/β``: the ring all-reduce's time in the α-β model."""
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / beta


def fit_ring(seconds: dict) -> tuple:
    """(α seconds per ring step, β bytes/s) of ``t = 2(N−1)·α + 2(N−1)/N·S/β`` — the form of
    :func:`minipar.machine.fidelity.fit_link` (its ``ring_terms``), fitted to ``seconds`` {(N, S bytes): t} over
    every N and size at once, so that one α and one β describe the whole sweep (pass only the N of
    :func:`fitted_ranks`). Plain least squares in seconds. Where the fitted size effect comes out ≤ 0 (the
    larger size was lost in the timing noise), 1/β is held at 0 (β = ∞) and α fitted alone."""
    rows = [(*ring_terms("all_reduce", n), s, t) for (n, s), t in seconds.items()]
    w = [1.0 for _ in rows]
    kk = sum(wi * k * k for wi, (k, f, s, t) in zip(w, rows))
    kx = sum(wi * k * f * s for wi, (k, f, s, t) in zip(w, rows))
    xx = sum(wi * (f * s) ** 2 for wi, (k, f, s, t) in zip(w, rows))
    kt = sum(wi * k * t for wi, (k, f, s, t) in zip(w, rows))
    xt = sum(wi * f * s * t for wi, (k, f, s, t) in zip(w, rows))
    det = kk * xx - kx * kx
    if len({s for _, s in seconds}) < 2 or det <= 0:
        raise ValueError(f"fitting α and β needs at least two sizes, got {sorted(seconds)}")
    alpha, inverse_beta = (xx * kt - kx * xt) / det, (kk * xt - kx * kt) / det
    if inverse_beta <= 0:    # the size effect is below the timing noise: least squares with 1/β ≥ 0 is then
        return max(kt / kk, 1e-7), math.inf    # β = ∞, α alone
    return max(alpha, 1e-7), 1 / inverse_beta


def beta_text(beta: float) -> str:
    """β as the chapter prints it; β = ∞ where the fit found no size effect (it says so, not why)."""
    return "∞ (the fit found no bandwidth term: the size effect is below the timing noise)" if math.isinf(beta) \
        else f"{beta / 1e9:.2g} GB/s"

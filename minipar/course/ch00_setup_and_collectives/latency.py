"""The ring's cost, timed: α and β fitted at N = 2 over a size sweep, and the same model with published links.

A ring all-reduce takes 2(N−1) steps, each a message that must arrive before the next is sent, so its time is
about 2(N−1)·α + 2(N−1)/N·S/β (α: a message's fixed cost, β: bandwidth; Patarasuk & Yuan 2009). The two terms
are equal at the crossover S* = N·α·β: below it the steps cost more, above it the bytes. α and β are fitted on 2
ranks (always within the cores) to a ring all-reduce of 16 B … 16 MiB (:func:`time_ring_sizes`): α on the small
sizes, β on the large ones (:func:`fit_ring`). On this
machine α is mostly Python's and gloo's per-message overhead (the ring is Python ``isend``/``recv``) plus any wait
for a core on a loaded machine, not a network: :data:`PUBLISHED_LINKS` gives
real links' α and β (published figures, not measured here) for the same model at N = 8 … 1024.
Times at larger N on this machine are measured only up to its cores (:func:`fitted_ranks`): with more ranks than
cores the processes take turns on the cores, and the time measures that waiting, not the ring's steps.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from minipar import comm, launch
from minipar.machine.fidelity import fit_link

__all__ = ["SMALL_BYTES", "RING_SIZES", "FIT_RANKS", "PUBLISHED_LINKS", "time_small_ring", "slowest_rank_fastest",
           "time_ring_sizes", "fit_ring", "crossover_bytes", "machine_cores", "fitted_ranks", "ring_model_seconds",
           "published_ring_rows", "NCCL_RING_LATENCY", "NCCL_VERSIONS", "nccl_link_type"]

SMALL_BYTES = 4096                                    # the small all-reduce: 1024 float32
RING_SIZES = tuple(16 * 4 ** i for i in range(11))    # 16 B, 64 B, … 16 MiB: six decades to fit α and β
FIT_RANKS = 2                                         # fitted on 2 ranks: never more ranks than cores
MIB, GIB = 2 ** 20, 2 ** 30

# Published figures, not measured here: {link: (α s per ring step, β bytes/s per direction, source)}.
# α: NCCL's own cost model, the latency it charges one ring step with its Simple protocol (src/graph/tuning.cc,
# table hwLat; its LL protocol for small messages charges 0.6 µs and 2.7 µs). β: the link's peak, per direction.
PUBLISHED_LINKS = {
    "NVLink 4, H100 SXM": (3.4e-6, 450e9, "NCCL hwLat; NVIDIA H100 datasheet: 900 GB/s both directions"),
    "InfiniBand NDR, a 400 Gb/s port": (14.0e-6, 50e9, "NCCL hwLat; NVIDIA ConnectX-7: 400 Gb/s"),
}
# NCCL's hwLat is indexed by link type, not generation: a ring step (Simple) costs this on any link of the type.
# Values of NCCL 2.18 to 2.30 (src/graph/tuning.cc); NCCL 2.12 charged a network ring step 28 µs, 2.14-2.17 9.6 µs.
NCCL_VERSIONS = "2.18-2.30"
NCCL_RING_LATENCY = {"NVLink": 3.4e-6, "PCI": 5.7e-6, "network": 14.0e-6}
NVLINK_DOMAIN = 8                                     # GPUs on one NVLink switch in an HGX/DGX H100 node


def nccl_link_type(link_name: str) -> str | None:
    """The row of NCCL's hwLat a link falls in: "NVLink", "PCI", "network" (InfiniBand), or None (not in the table)."""
    if link_name.startswith("NVLink"):
        return "NVLink"
    if link_name.startswith("PCIe"):
        return "PCI"
    return "network" if link_name.startswith("InfiniBand") else None


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


def _sizes_on_rank(rank, n, sizes):
    return {s: time_small_ring(s // 4, repeats=15 if s <= 2 ** 18 else 5) for s in sizes}   # small ones: cheap


def time_ring_sizes(world_size: int = FIT_RANKS, sizes=RING_SIZES) -> dict:
    """{S bytes: seconds} of a ring all-reduce of each size in one launch of ``world_size`` ranks: the slowest
    rank's fastest repeat (:func:`slowest_rank_fastest`)."""
    if world_size < 2 or any(s % (4 * world_size) for s in sizes):
        raise ValueError(f"sizes must be whole float32 chunks on {world_size} ≥ 2 ranks, got {sizes}")
    per_rank = launch(_sizes_on_rank, world_size, tuple(sizes), quiet=True)
    return {s: slowest_rank_fastest([p[s] for p in per_rank]) for s in sizes}


def fit_ring(seconds: dict, n: int = FIT_RANKS) -> tuple:
    """(α s per ring step, β bytes/s) of ``t = 2(N−1)·α + 2(N−1)/N·S/β`` for ``seconds`` {S: t} on n ranks, each
    term fitted where it dominates: β by :func:`minipar.machine.fidelity.fit_link` (in seconds) on the sizes from
    1 MiB (α is under 1 % there), then α as the median, over the sizes up to :data:`SMALL_BYTES`, of the time left
    after the bytes, per ring step (small times need not grow with size: there they are all steps). One fit
    over all sizes cannot do both on this machine: its time per byte is not one constant (caches, copies), and a
    fit in relative error put the 16 MiB point 2.3× above its line."""
    small = {s: t for s, t in seconds.items() if s <= SMALL_BYTES}
    large = {s: t for s, t in seconds.items() if s >= MIB}
    if len(small) < 2 or len(large) < 2:
        raise ValueError(f"fitting α and β needs two sizes ≤ {SMALL_BYTES} B and two ≥ 1 MiB, got {sorted(seconds)}")
    beta = fit_link("all_reduce", n, large, error="absolute")[0]
    steps = 2 * (n - 1)             # α: the small sizes' time left after their bytes, per ring step (median)
    per_step = sorted((t - steps / n * s / beta) / steps for s, t in small.items())
    return per_step[len(per_step) // 2], beta


def crossover_bytes(n: int, alpha: float, beta: float) -> float:
    """S* = N·α·β: the size where the steps 2(N−1)·α and the bytes 2(N−1)/N·S/β cost the same."""
    return n * alpha * beta


def published_ring_rows(ranks=(8, 64, 1024), sizes=(MIB, GIB)) -> list:
    """(link, N, {S: (model seconds, share of the steps)}) for each published link and N (NVLink only within its
    8-GPU node): the ring all-reduce priced by :func:`ring_model_seconds` with :data:`PUBLISHED_LINKS`."""
    rows = []
    for link, (alpha, beta, _) in PUBLISHED_LINKS.items():
        for n in ranks:
            if link.startswith("NVLink") and n > NVLINK_DOMAIN:
                continue
            rows.append((link, n, {s: (ring_model_seconds(n, s, alpha, beta),
                                       2 * (n - 1) * alpha / ring_model_seconds(n, s, alpha, beta)) for s in sizes}))
    return rows

"""The hardware side of the cost model: a cluster of nodes, its links, and what one collective costs on them.

α-β model: a ring collective over n ranks costs k·α + bytes_sent/β, k its number of steps (2(n-1) for an
all-reduce, n-1 for an all-gather or a reduce-scatter, 1 for a send), bytes_sent the ring's volume
(:func:`minipar.comm.predicted_bytes_sent`); α and β are the node's link if the group stays in a node, the
inter-node link if it crosses one. Ranks are laid out in :mod:`minipar.mesh`'s order (dp, pp, cp, ep, tp):
tp innermost, so a TP group stays in a node whenever t ≤ devices per node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from minipar.comm import predicted_bytes_sent
from minipar.mesh import DEFAULT_ORDER

__all__ = ["Cluster", "dgx_a100", "h100_nodes", "pcie_node", "this_machine", "CLUSTERS", "collective_seconds",
           "crosses_nodes", "link"]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``devices_per_node`` devices. Bandwidths in bytes/s per device and direction,
    latencies in seconds; ``flops_efficiency`` is the fraction of ``peak_flops`` matmuls really reach;
    ``optimizer_seconds_per_param``: what one optimizer step costs per parameter a device updates (0: not
    modelled, as for the papers' clusters, where it is a few % of a step; on a CPU it is measured)."""
    devices_per_node: int
    nodes: int
    memory_bytes: float
    peak_flops: float
    intra_bw: float
    inter_bw: float
    intra_latency: float = 0.0
    inter_latency: float = 0.0
    flops_efficiency: float = 1.0
    optimizer_seconds_per_param: float = 0.0

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes


def dgx_a100(nodes: int, memory_gb: int = 80, flops_efficiency: float = 0.6) -> Cluster:
    """DGX A100 nodes: 8 GPUs, 312 TFLOP/s (BF16 dense), NVLink 300 GB/s per direction, one 200 Gb/s
    HDR InfiniBand port per GPU (25 GB/s). Latencies are round numbers (5 µs, 10 µs), not measured.
    ``flops_efficiency`` 0.6: an assumption (Megatron's kernels reach about that on large matmuls)."""
    return Cluster(8, nodes, memory_gb * 10 ** 9, 312e12, 300e9, 25e9, 5e-6, 10e-6, flops_efficiency)


def h100_nodes(nodes: int, memory_gb: int = 80, flops_efficiency: float = 0.6) -> Cluster:
    """DGX H100 nodes: 8 H100 SXM5, 989 TFLOP/s BF16 dense (NVIDIA H100 datasheet); NVLink 4, 900 GB/s
    per GPU both directions together, so 450 GB/s per direction; one ConnectX-7 InfiniBand NDR port per
    GPU, 400 Gb/s = 50 GB/s (DGX H100 user guide). Latencies: round numbers (3 µs, 8 µs), not measured;
    ``flops_efficiency`` an assumption, as for :func:`dgx_a100`."""
    return Cluster(8, nodes, memory_gb * 10 ** 9, 989e12, 450e9, 50e9, 3e-6, 8e-6, flops_efficiency)


def pcie_node(devices: int = 2, flops_efficiency: float = 0.6) -> Cluster:
    """Seed 002's machine without NVLink (``NCCL_P2P_DISABLE=1``): TITAN RTX GPUs (24 GB, 130 TFLOP/s
    FP16 tensor cores, NVIDIA Turing whitepaper) talking over PCIe 3.0 x16, 15.75 GB/s per direction
    (the PCIe 3.0 specification: 8 GT/s · 16 lanes · 128/130). One node; latency 10 µs, a round number."""
    return Cluster(devices, 1, 24e9, 130e12, 15.75e9, 15.75e9, 10e-6, 10e-6, flops_efficiency)


def this_machine(alpha: float, beta: float, flops_per_second: float, devices: int = 4,
                 memory_bytes: float = 16e9) -> Cluster:
    """This machine as one node of ``devices`` CPU ranks: α (s) and β (bytes/s) of one ring step fitted
    to gloo here, and a rank's FLOP/s measured here — the numbers of chapter 12's ``calibrate`` /
    ``allreduce_link`` (pass them in: the library does not import the course). Efficiency 1: the FLOP/s
    are already what a rank reaches."""
    return Cluster(devices, 1, memory_bytes, flops_per_second, beta, beta, alpha, alpha, 1.0)


CLUSTERS = {"dgx-a100": dgx_a100, "h100": h100_nodes, "pcie": pcie_node}   # name -> factory (nodes or devices)


def _steps_and_bytes(op: str, payload: float, n: int) -> tuple:
    """(latency terms α, bytes over the busiest rank's link) of one collective: rings for all-reduce,
    all-gather and reduce-scatter; direct exchanges otherwise (n-1 messages from, or into, the root)."""
    if op in ("send", "recv"):
        return 1, payload
    if op in ("all_reduce", "all_gather", "reduce_scatter"):
        return (2 if op == "all_reduce" else 1) * (n - 1), predicted_bytes_sent(op, payload, n)
    if op in ("all_to_all", "scatter", "gather"):
        return n - 1, (n - 1) / n * payload
    if op in ("broadcast", "reduce"):
        return n - 1, (n - 1) * payload
    raise ValueError(f"no α-β model for {op!r}")


def collective_seconds(op: str, payload: float, n: int, bw: float, latency: float) -> float:
    """α-β time of one collective (or one send) of ``payload`` bytes over ``n`` ranks: steps · α +
    bytes sent by the busiest rank / β (ring all-reduce 2(n-1)·α + 2(n-1)/n · S/β, Patarasuk & Yuan 2009;
    all-gather, reduce-scatter (n-1)·α + (n-1)/n · S/β; all-to-all, scatter, gather the same, direct;
    broadcast, reduce (n-1)·(α + S/β) through the root)."""
    if n == 1 and op not in ("send", "recv"):
        return 0.0
    steps, sent = _steps_and_bytes(op, payload, n)
    return steps * latency + sent / bw


def crosses_nodes(layout, dim: str, cluster: Cluster) -> bool:
    """Does a ``dim`` group span more than one node (ranks laid out in minipar.mesh's order)?"""
    size = getattr(layout, dim)
    inner = math.prod(getattr(layout, d) for d in DEFAULT_ORDER[DEFAULT_ORDER.index(dim) + 1:])
    return size > 1 and inner * size > cluster.devices_per_node


def link(layout, dim: str, cluster: Cluster) -> tuple:
    """(bandwidth, latency) of the links a ``dim`` group's ring runs over."""
    if crosses_nodes(layout, dim, cluster):
        return cluster.inter_bw, cluster.inter_latency
    return cluster.intra_bw, cluster.intra_latency

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

__all__ = ["Cluster", "dgx_a100", "collective_seconds", "crosses_nodes", "link"]


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


def collective_seconds(op: str, payload: float, n: int, bw: float, latency: float) -> float:
    """α-β time of one ring collective (or one send) of ``payload`` bytes over ``n`` ranks."""
    if n == 1 and op != "send":
        return 0.0
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "send": 1}[op]
    sent = payload if op == "send" else predicted_bytes_sent(op, payload, n)
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

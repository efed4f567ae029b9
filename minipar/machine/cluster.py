"""The table of links: a cluster of nodes, its two links, and what one call costs on them — the one α-β model
that the planner (:mod:`minipar.plan`), the replay (:mod:`minipar.machine.replay`) and the fits
(:mod:`minipar.machine.fidelity`) all use.

α-β model: a call over n ranks costs t = k·α + f·S/β (:func:`alpha_beta_terms`): k its latency steps
(2(n-1) for a ring all-reduce, n-1 for an all-gather or a reduce-scatter, 1 for a send), f·S the bytes the
busiest rank sends (:func:`minipar.comm.predicted_bytes_sent`). α and β are the node's link if the group
stays in a node, the inter-node link if it spans nodes (:func:`link`), by the mesh's one rule: rank r sits
on node r // devices_per_node (:func:`minipar.mesh.crosses_nodes`).
"""
from __future__ import annotations

from dataclasses import dataclass

from minipar.comm import predicted_bytes_sent
from minipar.mesh import crosses_nodes

from .device import A100_SXM_80GB, H100_SXM, DeviceCard

__all__ = ["Cluster", "LinkCard", "NVLINK3", "NVLINK4", "IB_HDR", "IB_NDR", "PCIE3", "gpu_cluster", "a100_cluster",
           "h100_cluster", "dgx_a100",
           "h100_nodes", "pcie_node", "this_machine", "alpha_beta_terms", "collective_seconds", "link",
           "comm_seconds"]


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
    device: DeviceCard | None = None

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes


@dataclass(frozen=True)
class LinkCard:
    """One link as the collectives see it: ``bandwidth`` per device and direction (bytes/s, the datasheet's),
    ``latency`` per step (s), and ``efficiency``, the share of the bandwidth a large ring collective reaches
    (NCCL's "bus bandwidth" over the link's): a cluster built on it uses bandwidth × efficiency as β."""
    name: str
    bandwidth: float
    latency: float
    efficiency: float
    source: str = ""

    @property
    def beta(self) -> float:
        return self.bandwidth * self.efficiency


_ROUND = "latency and efficiency: round numbers of the size nccl-tests reports show, not measured here"
NVLINK3 = LinkCard("NVLink 3 (DGX A100)", 300e9, 5e-6, 0.77, "NVIDIA A100 datasheet: 600 GB/s both ways; " + _ROUND)
NVLINK4 = LinkCard("NVLink 4 (DGX H100)", 450e9, 3e-6, 0.80, "NVIDIA H100 datasheet: 900 GB/s both ways; " + _ROUND)
IB_HDR = LinkCard("InfiniBand HDR, a port per GPU", 25e9, 10e-6, 0.90, "HDR: 200 Gb/s per port; " + _ROUND)
IB_NDR = LinkCard("InfiniBand NDR, a port per GPU", 50e9, 8e-6, 0.90, "NDR: 400 Gb/s per port; " + _ROUND)
PCIE3 = LinkCard("PCIe 3.0 x16", 15.75e9, 10e-6, 0.80, "PCIe 3.0: 8 GT/s · 16 lanes · 128/130; " + _ROUND)


def gpu_cluster(card: DeviceCard, nodes: int, intra: LinkCard, inter: LinkCard, devices_per_node: int = 8
                ) -> Cluster:
    """``nodes`` nodes of ``devices_per_node`` ``card`` GPUs joined by ``intra`` inside a node and ``inter``
    across nodes: the cluster the device model prices (:mod:`minipar.machine.device`; the planner's compute
    is then the operators of :mod:`minipar.plan.operators`, a replay's the operators a trace counted)."""
    return Cluster(devices_per_node, nodes, card.memory_bytes, card.peak_flops, intra.beta, inter.beta,
                   intra.latency, inter.latency, card.gemm_efficiency, device=card)


def a100_cluster(nodes: int) -> Cluster:
    """DGX A100 nodes (A100 SXM4 80 GB, NVLink 3, InfiniBand HDR) with the device model."""
    return gpu_cluster(A100_SXM_80GB, nodes, NVLINK3, IB_HDR)


def h100_cluster(nodes: int, card: DeviceCard = H100_SXM) -> Cluster:
    """DGX H100 nodes (H100 SXM, NVLink 4, InfiniBand NDR) with the device model."""
    return gpu_cluster(card, nodes, NVLINK4, IB_NDR)


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


def alpha_beta_terms(op: str, n: int) -> tuple:
    """(k, f) of ``op`` on n ranks in ``t = k·α + f·S/β``: latency steps, and the share of the payload S the
    busiest rank sends. Rings for all-reduce (2(n-1), 2(n-1)/n; Patarasuk & Yuan 2009), all-gather and
    reduce-scatter (n-1, (n-1)/n); a send or recv (1, 1); direct exchanges otherwise, n-1 messages from, or
    into, the root: all-to-all, scatter, gather (n-1, (n-1)/n), broadcast and reduce (n-1, n-1)."""
    if op in ("send", "recv"):
        return 1, 1
    if op in ("all_reduce", "all_gather", "reduce_scatter"):
        return (2 if op == "all_reduce" else 1) * (n - 1), predicted_bytes_sent(op, 1, n)
    if op in ("all_to_all", "scatter", "gather"):
        return n - 1, (n - 1) / n
    if op in ("broadcast", "reduce"):
        return n - 1, n - 1
    raise ValueError(f"no α-β model for {op!r}")


def collective_seconds(op: str, payload: float, n: int, bw: float, latency: float) -> float:
    """α-β time of one collective (or one send) of ``payload`` bytes over ``n`` ranks on a link of bandwidth
    ``bw`` and latency ``latency``: k·α + f·S/β (:func:`alpha_beta_terms`); 0 for a group of one."""
    if n == 1 and op not in ("send", "recv"):
        return 0.0
    steps, share = alpha_beta_terms(op, n)
    return steps * latency + share * payload / bw


def link(cluster: Cluster, *groups) -> tuple:
    """(bandwidth, latency) of the slowest link the ``groups`` (each a collection of global ranks) run over:
    the inter-node link if any of them spans nodes (:func:`minipar.mesh.crosses_nodes`), else the node's."""
    if any(crosses_nodes(ranks, cluster.devices_per_node) for ranks in groups):
        return cluster.inter_bw, cluster.inter_latency
    return cluster.intra_bw, cluster.intra_latency


def comm_seconds(op: str, ranks, payload: float, cluster: Cluster) -> float:
    """α-β time of one call over ``ranks`` (global), on the link its group runs over (a replay's default
    ``comm_time``)."""
    return collective_seconds("send" if op in ("send", "recv") else op, payload, len(ranks),
                              *link(cluster, ranks))

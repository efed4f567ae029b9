"""The table of links: a cluster of nodes, its two links, and what one call costs on them — the one α-β model
that the planner (:mod:`minipar.plan`), the replay (:mod:`minipar.machine.replay`) and the fits
(:mod:`minipar.machine.fidelity`) all use.

α-β model: a call over n ranks costs t = k·α + f·S/β (:func:`alpha_beta_terms`): k its latency steps
(2(n-1) for a ring all-reduce, n-1 for an all-gather or a reduce-scatter, 1 for a send), f·S the bytes the
busiest rank sends (:func:`minipar.comm.predicted_bytes_sent`). α and β are the node's link if the group
stays in a node, the inter-node link if it spans nodes (:func:`link`), by the mesh's one rule: rank r sits
on node r // devices_per_node (:func:`minipar.mesh.crosses_nodes`).

Topology, as NCCL runs it across nodes (NCCL docs, "Environment variables" NCCL_ALGO; Sanders et al. 2009
for the double binary tree; the DGX A100/H100 user guides for the rails):

* **rails** — a DGX node has a NIC per GPU; NCCL opens a channel per NIC, so a ring whose group holds k
  GPUs of each node crosses the nodes on min(k, rails) NICs at once: β = min(NVLink, k·NIC). A group with
  one GPU per node (data parallelism beside TP 8) has its one NIC.
* **hierarchical all-reduce** — reduce-scatter inside the node (NVLink), all-reduce of the 1/k shard across
  nodes (each GPU its own NIC), all-gather inside the node.
* **tree** — NCCL's double binary tree: 2·log2(nodes) inter-node latencies instead of the ring's 2(n−1),
  2·S/β of bandwidth: it wins for small messages on many nodes.

:func:`comm_seconds` (the replays', the planner's and chapter 14's) runs the ring over the rails;
:func:`nccl_allreduce_seconds` the fastest of the three (:func:`allreduce_options`), as NCCL picks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from minipar.comm import predicted_bytes_sent
from minipar.mesh import crosses_nodes, node_of

from .device import A100_SXM_80GB, B200, H100_SXM, DeviceCard

__all__ = ["Cluster", "LinkCard", "NVLINK3", "NVLINK4", "NVLINK5", "IB_HDR", "IB_NDR", "ETH_100G", "PCIE3",
           "gpu_cluster", "a100_cluster", "h100_cluster", "nvl72_cluster", "allreduce_options", "nccl_allreduce_seconds",
           "this_machine", "alpha_beta_terms", "collective_seconds", "nccl_rooted_seconds", "link",
           "comm_seconds"]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``devices_per_node`` devices. Bandwidths in bytes/s per device and direction,
    latencies in seconds; ``flops_efficiency`` is the fraction of ``peak_flops`` matmuls really reach;
    ``optimizer_seconds_per_param``: what one optimizer step costs per parameter a device updates (0: not
    modelled, as for the papers' clusters, where it is a few % of a step; on a CPU it is measured).
    ``rails``: NICs per node a ring may cross on at once (``inter_bw`` is one NIC's)."""
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
    rails: int = 1

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
NVLINK5 = LinkCard("NVLink 5 (GB200 NVL72)", 900e9, 3e-6, 0.80, "NVIDIA GB200 NVL72 datasheet: 1.8 TB/s both ways "
                   "per GPU, 72 GPUs in one NVLink domain; " + _ROUND)
ETH_100G = LinkCard("100 Gb Ethernet, one NIC per node", 12.5e9, 20e-6, 0.90, "100 Gb/s; " + _ROUND)
PCIE3 = LinkCard("PCIe 3.0 x16", 15.75e9, 10e-6, 0.80, "PCIe 3.0: 8 GT/s · 16 lanes · 128/130; " + _ROUND)


def gpu_cluster(card: DeviceCard, nodes: int, intra: LinkCard, inter: LinkCard, devices_per_node: int = 8,
                rails: int | None = None) -> Cluster:
    """``nodes`` nodes of ``devices_per_node`` ``card`` GPUs joined by ``intra`` inside a node and ``inter``
    across nodes (``rails`` of them per node: a NIC per GPU by default, as in a DGX): the cluster the device
    model prices (:mod:`minipar.machine.device`; the planner's compute is then the operators of
    :mod:`minipar.plan.operators`, a replay's the operators a trace counted)."""
    return Cluster(devices_per_node, nodes, card.memory_bytes, card.peak_flops, intra.beta, inter.beta,
                   intra.latency, inter.latency, card.gemm_efficiency, device=card,
                   rails=devices_per_node if rails is None else rails)


def a100_cluster(nodes: int) -> Cluster:
    """DGX A100 nodes (A100 SXM4 80 GB, NVLink 3, InfiniBand HDR) with the device model."""
    return gpu_cluster(A100_SXM_80GB, nodes, NVLINK3, IB_HDR)


def h100_cluster(nodes: int, card: DeviceCard = H100_SXM) -> Cluster:
    """DGX H100 nodes (H100 SXM, NVLink 4, InfiniBand NDR) with the device model."""
    return gpu_cluster(card, nodes, NVLINK4, IB_NDR)


def nvl72_cluster(racks: int, card: DeviceCard | None = None) -> Cluster:
    """GB200 NVL72 racks: 72 GPUs in one NVLink 5 domain (a "node" of 72), InfiniBand NDR between racks, a
    NIC per GPU (``card``: :data:`minipar.machine.device.B200`, whose efficiencies are assumptions)."""
    return gpu_cluster(card or B200, racks, NVLINK5, IB_NDR, devices_per_node=72)



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


def nccl_rooted_seconds(op: str, payload: float, n: int, bw: float, latency: float) -> float:
    """A broadcast or reduce as NCCL runs it: a ring from (or to) the root with the payload pipelined in chunks,
    so every link, the root's too, carries about S once: (n−1)·α + S/β (the direct star of
    :func:`collective_seconds` puts (n−1)·S on the root's link). Source: NCCL's ring broadcast/reduce, whose
    bandwidth term does not grow with n; what ``torch.nn.parallel`` (``broadcast_coalesced``,
    ``reduce_add_coalesced``) calls on GPUs."""
    if op not in ("broadcast", "reduce"):
        raise ValueError(f"NCCL's rooted ring is a broadcast or a reduce, not {op!r}")
    return 0.0 if n == 1 else (n - 1) * latency + payload / bw


def _per_node(ranks, devices_per_node: int) -> tuple:
    """(nodes a group spans, most of its ranks on one node)."""
    counts = {}
    for r in ranks:
        counts[node_of(r, devices_per_node)] = counts.get(node_of(r, devices_per_node), 0) + 1
    return len(counts), max(counts.values())


def link(cluster: Cluster, *groups) -> tuple:
    """(bandwidth, latency) of the slowest link the ``groups`` (each a collection of global ranks) run over:
    the node's if none spans nodes (:func:`minipar.mesh.crosses_nodes`), else the rails a ring crosses on
    at once — a group with k ranks on a node uses min(k, rails) NICs, capped by the node's link."""
    crossing = [ranks for ranks in groups if crosses_nodes(ranks, cluster.devices_per_node)]
    if not crossing:
        return cluster.intra_bw, cluster.intra_latency
    k = min(_per_node(ranks, cluster.devices_per_node)[1] for ranks in crossing)
    rails = min(k, cluster.rails)
    bw = cluster.inter_bw if rails <= 1 else min(cluster.intra_bw, rails * cluster.inter_bw)
    return bw, cluster.inter_latency


def nccl_allreduce_seconds(ranks, payload: float, cluster: Cluster) -> float:
    """An all-reduce as NCCL would run it: on one node the ring, across nodes the fastest of
    :func:`allreduce_options`. Not the replays' default: with the link cards' round latencies (3 µs NVLink,
    8–10 µs InfiniBand per step) a small all-reduce over two half-filled nodes would come out cheaper than
    over one full node (fewer steps in a chain of 4 than in a ring of 8), which measured α's should decide."""
    if not crosses_nodes(ranks, cluster.devices_per_node):
        return comm_seconds("all_reduce", ranks, payload, cluster)
    return min(allreduce_options(ranks, payload, cluster).values())


def allreduce_options(ranks, payload: float, cluster: Cluster) -> dict:
    """{"ring", "hierarchical", "tree": seconds} of one all-reduce of ``payload`` bytes over ``ranks``
    (global) that span nodes: the ring over the rails (:func:`link`); reduce-scatter in the node, all-reduce
    of the 1/k shard across the nodes, all-gather in the node; NCCL's double binary tree (2·log2(nodes)
    inter-node and 2(k−1) intra-node latencies, 2·S/β)."""
    nodes, k = _per_node(ranks, cluster.devices_per_node)
    bw, latency = link(cluster, ranks)
    nic = cluster.inter_bw * min(1.0, cluster.rails / k)         # fewer NICs than GPUs: they share them
    inside = 2 * collective_seconds("reduce_scatter", payload, k, cluster.intra_bw, cluster.intra_latency)
    return {"ring": collective_seconds("all_reduce", payload, len(ranks), bw, latency),
            "hierarchical": inside + collective_seconds("all_reduce", payload / k, nodes, nic, latency),
            "tree": 2 * math.ceil(math.log2(nodes)) * latency + 2 * (k - 1) * cluster.intra_latency
                    + 2 * payload / bw}


def comm_seconds(op: str, ranks, payload: float, cluster: Cluster) -> float:
    """α-β time of one call over ``ranks`` (global), on the link its group runs over — across nodes the ring
    over the rails (a replay's default ``comm_time``; :func:`nccl_allreduce_seconds` picks NCCL's algorithm)."""
    return collective_seconds("send" if op in ("send", "recv") else op, payload, len(ranks),
                              *link(cluster, ranks))

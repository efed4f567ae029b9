"""Chapter 05, §9: tensor parallelism at a GPT-3 layer's size — the planner's estimate, not a measurement.

A model of GPT-3's layer shape (h = 12288, 96 heads, s = 2048, vocabulary 51200; :data:`GPT3_LAYERS` layers, so
the embedding and the output layer weigh little beside them) trained with TP degree t alone on t GPUs:
:func:`minipar.plan.estimate` on a cluster built from device and link cards
(:func:`minipar.machine.cluster.gpu_cluster`): compute is the layers' operators priced on the card (matmuls,
attention, memory-bound operators, a launch floor per kernel: :mod:`minipar.plan.operators`), the ``tp`` term
the α-β time of TP's all-reduces (4 per layer per micro-batch, Shoeybi et al. 2019) on the link the group
crosses. **8-GPU nodes** (DGX-like: NVLink inside, a NIC per GPU between nodes): the group on NVLink up to
t = 8, t = 16 spans two nodes; **2-GPU nodes**, a what-if: every group of t > 2 crosses InfiniBand.

Throughput per GPU = tokens of a step / (step seconds · t): what TP trades when it splits a layer t ways.
"""
from __future__ import annotations

import dataclasses

from minipar.machine.cluster import IB_HDR, IB_NDR, NVLINK3, NVLINK4, gpu_cluster
from minipar.machine.device import A100_SXM_80GB, H100_SXM
from minipar.plan import Layout, Transformer, estimate

__all__ = ["GPT3_LAYERS", "gpt3_shaped", "CARDS", "PLACEMENTS", "tp_throughput", "narrow_matmuls", "priced_with",
           "weight_state_gb"]

GPT3_LAYERS = 4
MICRO_BATCHES = 8                                  # 8 sequences of 2048 tokens a step: the optimizer amortized
CARDS = {"A100 (NVLink 3, IB HDR)": (A100_SXM_80GB, NVLINK3, IB_HDR),
         "H100 (NVLink 4, IB NDR)": (H100_SXM, NVLINK4, IB_NDR)}
PLACEMENTS = {"8-GPU nodes": 8, "2-GPU nodes (what-if)": 2}   # devices per node


def gpt3_shaped(layers: int = GPT3_LAYERS) -> Transformer:
    """GPT-3 175B's layer (Brown et al. 2020, Table 2.1: h = 12288, 96 heads, s = 2048), ``layers`` of them."""
    return Transformer(layers=layers, hidden=12288, heads=96, vocab=51200, seq_len=2048)


def tp_throughput(degrees=(1, 2, 4, 8, 16), model: Transformer | None = None) -> list:
    """One row per (card, placement, t): {"card", "placement", "t", "nodes", "compute", "tp", "step" (s),
    "tokens_per_gpu" (tokens/s per GPU), "tp_share" (tp / step)} of :func:`minipar.plan.estimate`."""
    model = model or gpt3_shaped()
    rows = []
    for card_name, (card, intra, inter) in CARDS.items():
        for placement, per_node in PLACEMENTS.items():
            for t in degrees:
                nodes = -(-t // per_node)
                cluster = gpu_cluster(card, nodes, intra, inter, devices_per_node=min(per_node, t))
                est = estimate(model, cluster, Layout(tp=t, micro_batch=1, micro_batches=MICRO_BATCHES))
                step = est.step_seconds
                rows.append({"card": card_name, "placement": placement, "t": t, "nodes": nodes,
                             "compute": est.time["compute"], "tp": est.time["tp"], "step": step,
                             "tokens_per_gpu": MICRO_BATCHES * model.seq_len / (step * t),
                             "tp_share": est.time["tp"] / step})
    return rows


def narrow_matmuls(efficiency: float = 0.6, degrees=(8, 16), card_name: str = "H100 (NVLink 4, IB NDR)",
                   model: Transformer | None = None) -> dict:
    """A sensitivity of :func:`tp_throughput`, which prices every matmul at the card's one large-matmul
    efficiency: {t: tokens/s per GPU} on 8-GPU nodes with the matmuls at ``efficiency`` instead, for the
    degrees whose matmuls are narrow (h/t = 1536 at t = 8, 768 at t = 16 for GPT-3's layer)."""
    model, (card, intra, inter) = model or gpt3_shaped(), CARDS[card_name]
    slower = dataclasses.replace(card, gemm_efficiency=efficiency)
    out = {}
    for t in degrees:
        cluster = gpu_cluster(slower, -(-t // 8), intra, inter, devices_per_node=min(8, t))
        step = estimate(model, cluster, Layout(tp=t, micro_batch=1, micro_batches=MICRO_BATCHES)).step_seconds
        out[t] = MICRO_BATCHES * model.seq_len / (step * t)
    return out


def priced_with() -> list:
    """The numbers :func:`tp_throughput` prices each card with, read from the clusters it builds: one line per
    card, its 16-bit dense peak FLOP/s and the share matmuls reach, and per link α (latency per ring step) and
    β (the datasheet bandwidth per GPU and direction times the share a large ring reaches)."""
    lines = []
    for card, intra, inter in CARDS.values():
        c = gpu_cluster(card, 2, intra, inter)
        links = "; ".join(f"{link.name.split(' (')[0].split(',')[0]}: α {1e6 * alpha:.0f} µs, β {bw / 1e9:g} GB/s"
                          for link, alpha, bw in ((intra, c.intra_latency, c.intra_bw),
                                                  (inter, c.inter_latency, c.inter_bw)))
        lines.append(f"{card.name}: peak {c.peak_flops / 1e12:.0f} TFLOP/s, matmul efficiency {c.flops_efficiency:.0%}; "
                     + links)
    return lines


def weight_state_gb(t: int, model: Transformer | None = None) -> float:
    """GB per GPU of the layers' weights, gradients and Adam state at TP degree t: 12h² parameters a layer
    (Q, K, V, the output projection, and the 4h MLP's two matrices), 16 bytes each in mixed precision (fp16
    weights and gradients, fp32 master weights, momentum and variance: Rajbhandari et al. 2020, §3.1), split t
    ways. The planner prices time only; this says which t fits a card at all."""
    model = model or gpt3_shaped()
    return 16 * 12 * model.hidden ** 2 * model.layers / t / 1e9

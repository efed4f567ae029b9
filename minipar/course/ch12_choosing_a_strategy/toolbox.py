"""What chapter 12b's cells show (the elective toolbox): layouts by hand, the OneFlow layout, the calculator's
views and the sequence sweep, one call per cell, each holding its sentences (:mod:`.claims`). Chapter 12's own
cells are in :mod:`.report`, which re-exports these so that 12b's notebook calls ``report.NAME``."""
from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt

from minipar import plan as mp
from minipar.machine.cluster import h100_cluster
from minipar.machine.device import H100_SXM
from minipar.plan import GPT3_175B, Layout, a100_cluster, estimate, parameters

from . import claims, figures, show

__all__ = ["hand_layouts", "calculator_views", "sequence", "oneflow_layout", "FA3_H100"]


def hand_layouts(best, cluster) -> None:
    """12b §1: the planner's pick beside two layouts by hand, as stacked memory bars, then their numbers."""
    ests, text = show.hand_layouts(best, cluster)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    figures.draw_memory_bars(ests, cluster.memory_bytes, ax)
    plt.show()
    print(text)


# FlashAttention-3's forward on H100 reaches about 740 TFLOP/s of 989 in FP16 (Shah et al. 2024): 12b §3's
# silent what-if for the H100 card's attention efficiency, which is FlashAttention-2's. The view prices Megatron-LM
# 2022's kernels (attention: two batched matmuls and a fused softmax), so it does not move.
FA3_H100 = 0.75


def calculator_views() -> dict:
    """Chapter 12b §3: the calculator's first view on the A100 and on the H100 card, term by term. The H100 with
    FlashAttention-3's attention efficiency is checked, not printed: this view's kernels leave it unchanged."""
    views = {name: figures.calculate(cluster=name) for name in figures.CALCULATOR_CLUSTERS}
    print(show.card_views(views))
    h100 = views["H100 card (device model)"]
    fa3 = estimate(GPT3_175B, h100_cluster(128, replace(H100_SXM, attention_efficiency=FA3_H100)), h100.layout)
    claims.check_memory_time_calculator(views["A100 card (device model)"], views, fa3)
    return views


def sequence(cluster) -> dict:
    """Chapter 12b §4: the layouts of :data:`figures.SWEEP_LAYOUTS` as the sequence grows, drawn; the longest that fits."""
    sweep = figures.sweep_sequence(GPT3_175B, cluster)
    fig, ax = plt.subplots(figsize=(7, 4))
    figures.draw_sequence_sweep(sweep, cluster.memory_bytes, ax)
    plt.show()
    fits = {k: max((s for s, e in pts if e.fits), default=None) for k, pts in sweep.items()}
    print("longest sequence that fits in 80 GB: " + ", ".join(f"{k} {v}" for k, v in fits.items()))
    claims.check_memory_over_sequence_length(fits)
    return fits


def oneflow_layout() -> None:
    """Chapter 12b §2: the OneFlow article's layout (64 stages × 6 nodes × 8 GPUs) for GPT-3, and for the 1T model of
    Narayanan et al.'s Table 1 without and with full recomputation, with its hardware FLOPs utilization."""
    seed_layout = Layout(dp=6, tp=8, pp=64, micro_batch=1, micro_batches=512)
    try:
        estimate(GPT3_175B, a100_cluster(384), seed_layout)
    except ValueError as exc:
        print("GPT-3 175B on the 64 × 6 × 8 layout:", exc)
    one_t = mp.NARAYANAN_1T
    print(f"{parameters(one_t) / 1e12:.3f} T parameters on {seed_layout.devices} GPUs, batch 3072:")
    for layout in (seed_layout, replace(seed_layout, recompute="full")):
        e_1t = estimate(one_t, a100_cluster(384), layout)
        print(f"  {show.layout_words(layout)}: {show.estimate_words(e_1t)}, "
              f"HFU {mp.hfu(one_t, 3072, e_1t.step_seconds, 3072, 312e12, layout.recompute):.1%}")
    claims.check_oneflow_articles_gpt_3_layout(seed_layout, one_t, e_1t)

"""Chapter 03's ZeRO++ row: qwZ + hpZ + qgZ on 4 ranks declared as 2 nodes of 2, Adam on the tiny
GPT (FP32), checked against its own rule run in one process (:func:`minipar.data.zeropp.zeropp_reference`),
not against one device: the int8 weights and gradients change the numbers. Plain ZeRO-3 runs in the same
launch, on the same rings, for the bytes across the node boundary and the loss gap.

For chapter 03's ``STRATEGIES``: ``("ZeRO++ (qwZ+hpZ+qgZ, 2 nodes)", zeropp_row)``.
"""
from __future__ import annotations

import statistics

from minipar.check import compare, gpt_recipe, train_reference
from minipar.course.tour import WORLD_SIZE, TourRow
from minipar.data import zeropp
from minipar.launcher import launch

__all__ = ["zeropp_row"]

PER_NODE, BLOCK = 2, 256
ZERO3 = dict(qwz=False, hpz=False, qgz=False)


def _recipe():
    return gpt_recipe(steps=3, batch_size=8, seq_len=16, optimizer="adam")


def _both_on_rank(rank, world_size, recipe):
    return {"ZeRO++": zeropp.parallel_train(rank, world_size, recipe, per_node=PER_NODE, block=BLOCK),
            "ZeRO-3": zeropp.parallel_train(rank, world_size, recipe, per_node=PER_NODE, block=BLOCK, **ZERO3)}


def zeropp_row() -> TourRow:
    recipe = _recipe()
    zeropp.validate(recipe, world_size=WORLD_SIZE, per_node=PER_NODE, block=BLOCK)
    per_rank = launch(_both_on_rank, WORLD_SIZE, recipe, quiet=True)
    runs = {name: [r[name] for r in per_rank] for name in ("ZeRO++", "ZeRO-3")}
    rule = compare(zeropp.zeropp_reference(recipe, WORLD_SIZE, block=BLOCK), runs["ZeRO++"])
    one_device = train_reference(recipe)
    baseline_ok = compare(one_device, runs["ZeRO-3"]).matches
    gap = compare(one_device, runs["ZeRO++"]).loss_diffs[-1]
    padded = [layout.padded_numel for _, layout in zeropp.flat_units(recipe.model(), WORLD_SIZE)]
    formula, cross_formula = zeropp.step_bytes(padded, WORLD_SIZE, PER_NODE, 4, block=BLOCK)
    zero3_formula, zero3_cross_formula = zeropp.step_bytes(padded, WORLD_SIZE, PER_NODE, 4, **ZERO3)
    sent = {n: statistics.mean(b for r in rs for b in r.sent) for n, rs in runs.items()}
    seen = [b for r in runs["ZeRO++"] for b in r.observed]
    observed = None if None in seen else statistics.mean(seen)
    N, g = WORLD_SIZE, PER_NODE
    cross = {n: statistics.mean(sum(r.cross_node[s] for r in rs) for s in range(recipe.steps))
             for n, rs in runs.items()}
    note = (f"int8 weights (qwZ) and gradients (qgZ, single-level all-to-all) in blocks of {BLOCK} with FP32 "
            f"scales, backward all-gather inside the node (hpZ); compared with its own rule in one process, not "
            f"with synchronous training; loss gap to one device after {recipe.steps} steps {gap:.2g}. Bytes "
            f"across the node boundary per step, all ranks: {cross['ZeRO++']:,.0f} (formula {cross_formula:,}) vs "
            f"ZeRO-3's {cross['ZeRO-3']:,.0f} (formula {zero3_cross_formula:,}), "
            f"×{cross['ZeRO-3'] / cross['ZeRO++']:.2f} less (paper: 4×, against FP16 with int4 gradients on a hierarchical all-to-all; here FP32, int8, "
            f"and the flat all-to-all sends N(N−g) = {N * (N - g)} chunks across where a ring sends n(N−1) = "
            f"{N // g * (N - 1)}); sent per rank ×"
            f"{sent['ZeRO-3'] / sent['ZeRO++']:.2f} less than ZeRO-3 ({zero3_formula:,} B); hpZ's secondary "
            f"shard {runs['ZeRO++'][0].secondary_bytes:,} B per rank (Ψ/g)")
    return TourRow("ZeRO++ (qwZ+hpZ+qgZ, 2 nodes)", WORLD_SIZE, rule.matches and baseline_ok, rule.max_abs_diff,
                   sent["ZeRO++"], formula, None, note, bytes_observed_per_rank=observed, kind="update rule",
                   calls_per_rank=statistics.mean(c for r in runs["ZeRO++"] for c in r.sends))

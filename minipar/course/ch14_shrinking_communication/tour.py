"""Chapter 14 in the tour: PowerSGD and DiLoCo on 4 ranks, each compared with its own update rule run in one
process (float64; kind "update rule": by design neither equals synchronous training), bytes per step from the
communication log beside the formula (PowerSGD: 2(N−1)/N·b·(Σ (n+m)·r + uncompressed); DiLoCo: one all-reduce of
the parameters every H steps). ZeRO++, the third method the chapter runs, has its row in chapter 03.
"""
from __future__ import annotations

import torch

from minipar.check import compare, gpt_recipe
from minipar.course.tour import WORLD_SIZE, TourRow

__all__ = ["STRATEGIES"]


def _param_bytes(recipe) -> int:
    return sum(p.numel() * p.element_size() for p in recipe.model().parameters())


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _powersgd() -> TourRow:
    """PowerSGD at rank 2: compared with its own rule run in one process (float64), not with
    synchronous training; bytes per step = 2(N−1)/N · b · (Σ (n+m)·r + uncompressed)."""
    from minipar.data import powersgd
    recipe = gpt_recipe(steps=3, batch_size=8)
    recipe.dtype = torch.float64
    runs = powersgd.run(recipe, world_size=WORLD_SIZE, rank_r=2)
    c = compare(powersgd.powersgd_reference(recipe, WORLD_SIZE, 2), runs, dtype=torch.float64)
    shapes = [p.shape for p in recipe.model().parameters()]
    formula = powersgd.powersgd_bytes(shapes, 2, WORLD_SIZE, 8)
    sent = sum(sum(r.bytes_sent) / len(r.bytes_sent) for r in runs) / len(runs)
    wires = [w for r in runs for w in r.wire_bytes]
    observed = None if None in wires else sum(wires) / len(wires)
    ddp_bytes = 2 * (WORLD_SIZE - 1) / WORLD_SIZE * _param_bytes(recipe) * 2     # float64: 8 bytes, not 4
    note = (f"rank-2 approximation of each gradient matrix, error feedback, warm start; compared with its own "
            f"rule in one process, not with synchronous training; {ddp_bytes / formula:.1f}x fewer bytes than "
            f"DDP's all-reduce ({ddp_bytes:,.0f} B)")
    return TourRow("PowerSGD r=2", WORLD_SIZE, c.matches, c.max_abs_diff, sent, formula, None, note,
                   bytes_observed_per_rank=observed, kind="update rule", calls_per_rank=3)


def _diloco() -> TourRow:
    """DiLoCo, H = 2 inner AdamW steps per outer Nesterov step, against its own rule in one process
    (float64); bytes: one all-reduce of the parameters per H steps, 2(N−1)/N · b · Ψ / H per step."""
    from minipar.data import diloco
    recipe = gpt_recipe(steps=4, batch_size=8)
    recipe.dtype, recipe.optimizer = torch.float64, _adamw
    runs = diloco.run(recipe, world_size=WORLD_SIZE, H=2)
    c = compare(diloco.diloco_reference(recipe, WORLD_SIZE, 2), runs, dtype=torch.float64)
    psi_bytes = _param_bytes(recipe) * 2                                      # float64
    formula = 2 * (WORLD_SIZE - 1) / WORLD_SIZE * psi_bytes / 2
    sent = sum(sum(r.bytes_sent) / len(r.bytes_sent) for r in runs) / len(runs)
    wires = [w for r in runs for w in r.wire_bytes]
    observed = None if None in wires else sum(wires) / len(wires)
    note = ("H = 2 inner AdamW steps per replica, then the mean pseudo-gradient θ − θ_replica and an outer Nesterov "
            "step (lr 0.7, momentum 0.9); compared with its own rule in one process, not with synchronous "
            "training; bytes per step = one all-reduce of the parameters every H steps")
    return TourRow("DiLoCo H=2", WORLD_SIZE, c.matches, c.max_abs_diff, sent, formula, None, note,
                   bytes_observed_per_rank=observed, kind="update rule", calls_per_rank=0.5)


STRATEGIES = [("PowerSGD r=2", _powersgd), ("DiLoCo H=2", _diloco)]

"""Loss against bytes: DDP, PowerSGD and DiLoCo trained on the same token budget, for chapter 14's plot.

Every method sees the same global batches (the same tokens, in the same order) on the same N ranks and is
scored the same way: the mean loss of its final parameters on held-out batches (for DiLoCo the outer
parameters θ). Bytes are what one rank sent over the whole run as :mod:`minipar.comm` modelled them (the
training's collectives only; the loss reporting is not counted)::

    DDP            T · 2(N−1)/N · b·Ψ
    PowerSGD r     T · 2(N−1)/N · b·(Σ_compressed (n+m)·r + Σ_rest numel)
    DiLoCo H       T/H · 2(N−1)/N · b·Ψ          (streaming, F fragments: the same total)

    rows = loss_vs_bytes()       # [(method, bytes sent per rank, held-out loss)]
"""
from __future__ import annotations

import torch

from minipar import comm
from minipar.data import ddp, diloco, powersgd
from minipar.launcher import launch
from minipar.recipe import Recipe, gpt_recipe

__all__ = ["study_recipe", "held_out_loss", "loss_vs_bytes"]


def study_recipe(steps: int, eval_batches: int = 4, **cfg):
    """(the training recipe: ``steps`` batches of a tiny GPT with AdamW, the held-out batches after them)."""
    cfg = {"batch_size": 8, "seq_len": 16, "n_layer": 2, "n_embd": 16, "n_head": 2, **cfg}
    full = gpt_recipe(steps=steps + eval_batches, **cfg)
    recipe = Recipe(full.model, full.batches[:steps], lambda ps: torch.optim.AdamW(ps, lr=3e-3), full.loss,
                    name=f"{full.name.split(',')[0]}, AdamW")
    return recipe, full.batches[steps:]


@torch.no_grad()
def held_out_loss(recipe, params: dict, batches) -> float:
    """Mean loss of ``recipe``'s model with ``params`` on ``batches``."""
    model = recipe.model().to(recipe.dtype)
    model.load_state_dict(params, strict=False)
    return sum(recipe.loss(model, x, y).item() for x, y in batches) / len(batches)


def _ddp_bytes(rank, world_size, recipe):
    log = comm.CommLog()
    result = ddp.parallel_train(rank, world_size, recipe, step_log=log)
    return result, log.bytes_sent


def loss_vs_bytes(world_size: int = 2, steps: int = 100, ranks=(1, 2, 4), Hs=(10, 50), fragments: int = 2,
                  **cfg) -> list:
    """[(method, bytes sent per rank over the run, held-out loss)] for DDP, PowerSGD at each r in ``ranks``,
    DiLoCo at each H in ``Hs`` (paper's outer Nesterov: lr 0.7, momentum 0.9) and streaming DiLoCo with
    ``fragments`` fragments at the largest H, all on ``steps`` global batches."""
    recipe, held_out = study_recipe(steps, **cfg)
    rows = []
    result, sent = launch(_ddp_bytes, world_size, recipe, quiet=True)[0]
    rows.append(("DDP", sent, held_out_loss(recipe, result.params, held_out)))
    for r in ranks:
        result = powersgd.run(recipe, world_size=world_size, rank_r=r)[0]
        rows.append((f"PowerSGD r={r}", sum(result.bytes_sent), held_out_loss(recipe, result.params, held_out)))
    for H in Hs:
        result = diloco.run(recipe, world_size=world_size, H=H)[0]
        rows.append((f"DiLoCo H={H}", sum(result.bytes_sent), held_out_loss(recipe, result.params, held_out)))
    if fragments > 1:
        H = max(Hs)
        result = diloco.run(recipe, world_size=world_size, H=H, fragments=fragments)[0]
        rows.append((f"Streaming DiLoCo H={H} F={fragments}", sum(result.bytes_sent),
                     held_out_loss(recipe, result.params, held_out)))
    return rows

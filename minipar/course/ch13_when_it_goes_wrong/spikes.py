"""Chapter 13 §6b: a loss spike without a NaN — one batch of outliers, the gradient norm logged every step, and
the guard that skips a step whose norm jumps.

The guard (a common practice; PaLM's authors instead restarted ~100 steps back and skipped 200–500 batches,
Chowdhery et al. 2022, §5.1): after ``warmup`` steps, skip the optimizer step when

    ‖g‖ > factor · median(‖g‖ of the last ``window`` steps taken)

The norm is computed anyway for the log, so the guard costs one comparison a step.
"""
from __future__ import annotations

import statistics

import torch

from minipar.recipe import mlp_recipe

__all__ = ["spiked_run"]


def spiked_run(guard: float | None, bad_step: int = 12, outlier: float = 30.0, steps: int = 24,
               warmup: int = 3, window: int = 8, clip: float | None = None, bad_steps: int = 1,
               flipped: bool = False) -> dict:
    """Train the regression MLP with SGD for ``steps`` steps; the ``bad_steps`` batches from ``bad_step`` on are
    ``outlier`` times larger (inputs and targets; ``flipped``: the targets alone, times −``outlier``, a corrupt
    shard whose gradient points the wrong way, so clipping shortens a harmful step but still takes it). ``guard``: the factor over the recent median norm past which a step is skipped
    (None: no guard). ``clip``: scale ``g`` down to norm ``clip`` when it is longer (``clip_grad_norm_``;
    None: no clipping). Returns {"norm": [‖g‖ per step], "loss": [loss on a fixed clean batch after each step],
    "skipped": [steps skipped]}."""
    recipe = mlp_recipe(steps=steps + 1, batch_size=32, seed=1)
    model, (x_eval, y_eval) = recipe.model(), recipe.batches[-1]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {"norm": [], "loss": [], "skipped": []}
    for step, (x, y) in enumerate(recipe.batches[:steps]):
        if bad_step <= step < bad_step + bad_steps:
            x, y = (x, -outlier * y) if flipped else (x * outlier, y * outlier)   # a corrupt shard, a unit bug
        opt.zero_grad()
        recipe.loss(model, x, y).backward()
        max_norm = float("inf") if clip is None else clip
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))   # the norm before clipping
        taken = [n for i, n in enumerate(out["norm"]) if i not in out["skipped"]][-window:]
        if guard is not None and len(taken) >= warmup and norm > guard * statistics.median(taken):
            out["skipped"].append(step)
        else:
            opt.step()
        out["norm"].append(norm)
        with torch.no_grad():
            out["loss"].append(float(recipe.loss(model, x_eval, y_eval)))
    return out

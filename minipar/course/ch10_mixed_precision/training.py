"""Chapter 10's training run: the tiny GPT trained for a few hundred Adam steps in FP32, in mixed precision
(FP16 with FP32 masters and the loss scaler; BF16 with FP32 masters, no loss scaler), and in BF16 without
FP32 masters (the weights and Adam's update in BF16): the model-level view of §5's vanishing updates."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch

from minipar.check import gpt_recipe, one_thread, train_reference
from minipar.precision.mixed import fp32_loss, train_mixed

from . import claims

__all__ = ["train_four_ways", "show_training"]

FP32, FP16_MASTERS, BF16_MASTERS, BF16_ONLY = ("FP32", "FP16 + FP32 masters + scaler",
                                               "BF16 + FP32 masters, no scaler", "BF16, no FP32 masters")


def _bf16_only(recipe) -> tuple:
    """Every weight, gradient and Adam state in BF16: w + u is rounded to BF16 at every step. Returns (the
    losses, (LayerNorm gain values that moved from 1.0, all of them))."""
    model = recipe.model().to(torch.bfloat16)
    opt = recipe.optimizer(model.parameters())
    losses = []
    for x, y in recipe.batches:
        loss = fp32_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    gains = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if ".ln" in f".{n}" and n.endswith("weight")])
    return losses, (int((gains != 1).sum()), gains.numel())


def train_four_ways(steps: int = 200, lr: float = 1e-3) -> SimpleNamespace:
    """``losses``: {run: [loss per step]} of the same tiny GPT, batches and Adam (``lr``) in the four
    precisions; ``gains_moved``: (LayerNorm gain values moved, all of them) in the run without masters;
    ``fp16_skipped``: the steps (from 0) FP16's loss scaler skipped on an overflow; ``fp16_scales``: the loss
    scale each FP16 step used; ``fp16_growth_interval``: its scaler's clean steps before it grows."""
    recipe = dataclasses.replace(gpt_recipe(steps=steps), optimizer=lambda ps: torch.optim.Adam(ps, lr=lr))
    with one_thread():
        fp16, fp16_mp = train_mixed(recipe, torch.float16)
        losses = {FP32: train_reference(recipe).losses, FP16_MASTERS: fp16.losses,
                  BF16_MASTERS: train_mixed(recipe, torch.bfloat16)[0].losses}
        losses[BF16_ONLY], gains_moved = _bf16_only(recipe)
    history = fp16_mp.scaler.history                          # (scale used, overflow found, stepped) per step
    skipped = [i for i, (_, _, stepped) in enumerate(history) if not stepped]
    return SimpleNamespace(losses=losses, gains_moved=gains_moved, lr=lr, fp16_skipped=skipped,
                           fp16_scales=[int(scale) for scale, _, _ in history],
                           fp16_growth_interval=fp16_mp.scaler.growth_interval)


def _mean_last(losses, n: int = 20) -> float:
    return sum(losses[-n:]) / n


def show_training(trained: SimpleNamespace) -> None:
    """Each run's loss curve and its gap to FP32's; per run, the final loss (mean of the
    last 20) and the largest |loss − FP32 loss| over the run, and before FP16's first skipped step; FP16's scaler
    settings and the step it skipped; how many LayerNorm gains moved without masters."""
    runs, lr = trained.losses, trained.lr
    ref = runs[FP32]
    gap = {name: [a - b for a, b in zip(losses, ref)] for name, losses in runs.items() if name != FP32}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    colour = dict(zip(runs, ("black", "#DD8452", "#4C72B0", "#C44E52")))
    for name, losses in runs.items():
        left.plot(losses, lw=1, color=colour[name], label=name)
    for name, g in gap.items():
        right.plot(g, lw=1, color=colour[name], label=name)
    left.set(xlabel="step", ylabel="loss", title=f"the tiny GPT, Adam lr = {lr:g} (three curves overlap)")
    right.set(xlabel="step", ylabel="loss − FP32 loss", title="gap to FP32")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    skipped = trained.fp16_skipped
    masters = (FP16_MASTERS, BF16_MASTERS)
    first = skipped[0] if skipped else len(ref)           # the gap splits at FP16's first skip: one update behind after it
    if skipped:
        scale, interval = trained.fp16_scales[first], trained.fp16_growth_interval
        print(f"FP16's scaler: loss scale {scale:,.0f} (2^{scale.bit_length() - 1}), grown only after {interval} "
              f"clean steps in a row, so never in {len(ref)}.\nAt step {first + 1} some gradient times {scale:,.0f} "
              f"overflowed FP16: that step was skipped and the scale halved.")
    head = f"before step {first + 1}" if skipped else "(no skip)"
    print(f"max |loss - FP32 loss| over the whole run, and before FP16's skip:\n"
          f"{'run':32}{'final loss':>11}{'whole run':>11}{head:>17}")
    for name, losses in runs.items():
        g = [abs(x) for x in gap.get(name, [0.0])]
        print(f"{name:32}{_mean_last(losses):11.4f}{max(g):11.4f}{max(g[:first], default=0.0):17.4f}")
    moved, gains = trained.gains_moved
    print(f"Final loss: the mean of the last 20 steps. Without masters, |w| / lr = {1 / lr:.0f} for a LayerNorm "
          f"gain at 1: {moved} of its {gains} gain values moved.")
    before = {m: max((abs(x) for x in gap[m][:skipped[0]]), default=0.0) for m in masters} if skipped else {}
    window = {m: _mean_last([abs(x) for x in gap[m][:skipped[0]]]) for m in masters} if skipped else {}
    after = {m: max((abs(x) for x in gap[m][skipped[0]:]), default=0.0) for m in masters} if skipped else {}
    claims.check_fp16_gap_is_the_skip(skipped, before, window, len(ref), after)
    claims.check_masters_follow_fp32(_mean_last(ref), {m: _mean_last(runs[m]) for m in masters},
                                     {m: max(abs(x) for x in gap[m]) for m in masters},
                                     _mean_last(runs[BF16_ONLY]), ref[0], trained.gains_moved)

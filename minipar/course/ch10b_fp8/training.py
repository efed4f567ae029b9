"""Chapter 10b §5: the tiny GPT trained in BF16 and with FP8 GEMMs, over several seeds, at a learning rate at
which its training is stable.

Why several seeds and why this learning rate: at Adam's lr 1e-2 (the course's default) this model is past
its stable range — after 20 steps its loss is ~3.4 at lr 1e-2 against ~2.2 at 3e-3 — and two runs that differ
by any rounding part within a few steps: FP32 against BF16 alone differed by −5.7 % to +2.6 % over four seeds
there, as much as the FP8 recipes did. One seed at that rate measures the chaos, not FP8. At lr 1e-3 the runs
stay together, and a difference is read against two yardsticks measured beside it:

* BF16's own seed-to-seed spread (sd over the seeds of its final loss, relative to their mean): how much the
  result moves with nothing but the data order and the initial weights changed;
* the FP8 path with quantization made the identity (1×1 blocks: every value is its own block and lands on
  ±max exactly), which runs every step of the emulation — scales, casts, the transposed weight blocks — with
  the quantization error taken out: what is left is the FP32-vs-BF16 GEMM rounding, the noise floor of a pair.

Per seed s the gap is (final(FP8, s) − final(BF16, s)) / final(BF16, s), final = mean of the last ``TAIL``
losses (:func:`minipar.precision.fp8_train.loss_gap`); seeds pair the runs (same data, same initial weights).
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from minipar.check import Recipe, gpt_recipe, one_thread
from minipar.course.report import Report
from minipar.precision.fp8 import FP8Recipe
from minipar.precision.fp8_train import final_loss, loss_gap, train_bf16, train_fp8

__all__ = ["one_thread", "SEEDS", "LR", "STEPS", "TAIL", "RECIPES", "IDENTITY", "DEEPSEEK_V3_GAP", "seed_recipe",
           "run_study", "study_report"]

SEEDS = (0, 1, 2)
LR = 1e-3                      # Adam; stable for this model (see above)
STEPS, TAIL, LAYERS = 6, 3, 1
IDENTITY = "FP8 path, quantization = identity (1×1 blocks)"
RECIPES = {"tensor-wise": FP8Recipe("tensor"), "row-wise": FP8Recipe("row"), "block-wise": FP8Recipe("block"),
           IDENTITY: FP8Recipe("block", block=1)}
DEEPSEEK_V3_GAP = 0.0025       # DeepSeek-V3 §3.3: relative loss error below 0.25 % against BF16


def seed_recipe(seed: int = 0, steps: int = STEPS, lr: float = LR) -> Recipe:
    """The 128-wide, one-block tiny GPT (a 1×128 tile and a 128×128 block are real) with Adam at ``lr``; ``seed`` sets
    the initial weights and the data."""
    base = gpt_recipe(steps=steps, batch_size=8, n_embd=128, n_layer=LAYERS, seed=seed)
    return dataclasses.replace(base, optimizer=lambda params: torch.optim.Adam(params, lr=lr),
                               name=f"{base.name.removesuffix('adam')}Adam lr {lr:g}, seed {seed}")


def run_study(seeds=SEEDS, steps: int = STEPS, lr: float = LR, recipes: dict | None = None) -> dict:
    """{name: {seed: losses}} for BF16 and every FP8 recipe, each seed's runs on the same data and weights."""
    recipes = RECIPES if recipes is None else recipes
    curves = {"BF16": {}, **{name: {} for name in recipes}}
    with one_thread():
        for seed in seeds:
            r = seed_recipe(seed, steps, lr)
            curves["BF16"][seed] = train_bf16(r).losses
            for name, fp8 in recipes.items():
                curves[name][seed] = train_fp8(r, fp8)[0].losses
    return curves


def _check(r: Report) -> None:
    """What the chapter's text says: the identity path is the tightest pair (it is BF16 up to GEMM rounding),
    every FP8 recipe's mean gap stands above that floor, and lies below BF16's own seed-to-seed spread."""
    fp8 = [n for n in r.gaps if n != IDENTITY]
    assert r.noise < min(max(abs(g) for g in r.gaps[n].values()) for n in fp8)
    assert min(abs(r.mean_gap[n]) for n in fp8) > 2 * r.noise           # "N× or more that floor" (N ≥ 2)
    assert all(abs(r.mean_gap[n]) < r.bf16_spread for n in r.gaps), (r.mean_gap, r.bf16_spread)


def study_report(curves: dict, tail: int = TAIL) -> Report:
    """Per seed: BF16's final loss and each recipe's gap to it; then mean ± sd of the gap over the seeds,
    BF16's seed-to-seed spread, and the sentence about them, written from these numbers."""
    seeds = list(curves["BF16"])
    names = [n for n in curves if n != "BF16"]
    bf16 = {s: final_loss(curves["BF16"][s], tail) for s in seeds}
    gaps = {n: {s: loss_gap(curves[n][s], curves["BF16"][s], tail) for s in seeds} for n in names}
    mean_gap = {n: statistics.mean(gaps[n].values()) for n in names}
    sd_gap = {n: statistics.stdev(gaps[n].values()) if len(seeds) > 1 else 0.0 for n in names}
    spread = statistics.stdev(bf16.values()) / statistics.mean(bf16.values()) if len(seeds) > 1 else 0.0
    width = max(len(n) for n in names) + 2
    steps = len(curves["BF16"][seeds[0]])
    lines = [f"final loss = mean of the last {tail} of {steps} steps; gap = (FP8 − BF16) / BF16",
             f"{'':{width}}" + "".join(f"{'seed ' + str(s):>10}" for s in seeds) + f"{'mean ± sd':>18}",
             f"{'BF16 final loss':{width}}" + "".join(f"{bf16[s]:>10.4f}" for s in seeds)
             + f"{statistics.mean(bf16.values()):>9.4f} ± {spread:.2%}"]
    for n in names:
        lines.append(f"{n + ' gap':{width}}" + "".join(f"{gaps[n][s]:>+10.3%}" for s in seeds)
                     + f"{mean_gap[n]:>+9.3%} ± {sd_gap[n]:.3%}")
    fp8_names = [n for n in names if n != IDENTITY]
    worst = max(fp8_names, key=lambda n: max(abs(g) for g in gaps[n].values()))
    worst_gap = max(abs(g) for g in gaps[worst].values())
    noise = max(abs(g) for g in gaps[IDENTITY].values())
    params = sum(p.numel() for p in seed_recipe(seeds[0]).model().parameters())
    floor_ratio = min(abs(mean_gap[n]) for n in fp8_names) / max(noise, 1e-12)
    lines.append(
        f"\nBF16's final loss moves by {spread:.2%} (sd) from seed to seed; the FP8 recipes' mean gaps are "
        + ", ".join(f"{n} {mean_gap[n]:+.3%}" for n in fp8_names)
        + f" — {spread / max(abs(mean_gap[n]) for n in fp8_names):.0f}× or more below that spread. With the "
          f"quantization taken out (1×1 blocks) the gap is at most {noise:.3%}, so the emulated path adds only "
          f"rounding, and the FP8 gaps, {floor_ratio:.0f}× or more that floor, are what quantization costs here. "
          f"The largest single gap, {worst} on one seed, is {worst_gap:.3%} — "
        + ("below" if worst_gap < DEEPSEEK_V3_GAP else "above")
        + f" DeepSeek-V3's {DEEPSEEK_V3_GAP:.2%}, for {len(seeds)} seeds × {len(curves['BF16'][seeds[0]])} steps "
          f"of a {params / 1e6:.2f}M-parameter model, not the 16B–230B runs of the claim.")
    return Report("\n".join(lines), _check, gaps=gaps, mean_gap=mean_gap, sd_gap=sd_gap, bf16=bf16,
                  bf16_spread=spread, worst=worst, worst_gap=worst_gap, noise=noise, seeds=seeds)

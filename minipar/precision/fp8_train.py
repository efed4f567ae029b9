"""Training with FP8 GEMMs: the recipe's model with every ``nn.Linear`` an :class:`~minipar.precision.fp8.FP8Linear`,
inside BF16 mixed precision (FP32 master weights and optimizer state, BF16 everything that is not a GEMM:
embeddings, LayerNorm, softmax, GeLU, the loss in FP32) — the layout of DeepSeek-V3 §3.3 and Transformer
Engine, where only the GEMMs' inputs are FP8 and their outputs come back in BF16.

Compared with the same recipe in plain BF16 mixed precision for the same steps on the same data: the gap of
the final loss (mean of the last ``tail`` steps, so that one noisy batch does not decide) is the measure.
DeepSeek-V3 reports a relative loss error below 0.25 % against BF16 at 16B-230B scale.
"""
from __future__ import annotations

import dataclasses

import torch

from ..recipe import Recipe, RunResult
from .fp8 import FP8Recipe, to_fp8
from .mixed import train_mixed

__all__ = ["fp8_training_recipe", "train_bf16", "train_fp8", "final_loss", "loss_gap"]


def fp8_training_recipe(recipe: Recipe, fp8: FP8Recipe) -> Recipe:
    """``recipe`` whose model has its Linear layers in FP8 under ``fp8`` (same parameters, same names)."""
    build = recipe.model
    return dataclasses.replace(recipe, model=lambda: to_fp8(build(), fp8), name=f"{recipe.name}, {fp8.name}")


def train_bf16(recipe: Recipe) -> RunResult:
    """The baseline: BF16 mixed precision on one device."""
    return train_mixed(recipe, torch.bfloat16)[0]


def train_fp8(recipe: Recipe, fp8: FP8Recipe) -> tuple:
    """FP8 GEMMs inside BF16 mixed precision on one device. Returns (RunResult, values saturated by delayed
    scaling, summed over the layers)."""
    result, mp = train_mixed(fp8_training_recipe(recipe, fp8), torch.bfloat16)
    return result, sum(getattr(m, "saturated", 0) for m in mp.model.modules())


def final_loss(losses, tail: int = 10) -> float:
    """Mean of the last ``tail`` losses."""
    tail = min(tail, len(losses))
    return sum(losses[-tail:]) / tail


def loss_gap(losses, baseline_losses, tail: int = 10) -> float:
    """Relative gap of the final losses: (final(losses) - final(baseline)) / final(baseline)."""
    base = final_loss(baseline_losses, tail)
    return (final_loss(losses, tail) - base) / base

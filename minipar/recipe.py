"""What to train and what a run saw: the two records every strategy and the equivalence harness share.

A :class:`Recipe` says what to train: a deterministic model factory, an optimizer factory, the global
batches (one per optimizer step) and a loss. A strategy's ``parallel_train`` trains it on every rank and
returns a :class:`RunResult`: the losses it saw (``None`` on a rank that never computes the loss) and the
full parameters it can report, under the reference model's names. :func:`gpt_recipe` and :func:`mlp_recipe`
are ready-made recipes for the reference models. They live on the ground floor, beside the models and the
datasets, so a strategy needs them without importing the test harness (:mod:`minipar.check`, which
re-exports them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .datasets import lm_batches, markov_tokens, regression_batches
from .loop import lm_loss
from .models import MLP, GPTConfig, TinyGPT

__all__ = ["Recipe", "RunResult", "default_loss", "gpt_recipe", "mlp_recipe"]


def default_loss(model: nn.Module, inputs, targets) -> torch.Tensor:
    """Cross-entropy for integer targets (language modelling), mean squared error otherwise."""
    out = model(inputs)
    if targets.dtype == torch.long:
        return lm_loss(out, targets)
    return F.mse_loss(out, targets)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@dataclass
class Recipe:
    """What to train. ``model()`` must build the same weights every time it is called."""
    model: Callable[[], nn.Module]
    batches: list                                   # [(inputs, targets)] global batches, one per step
    optimizer: Callable = _sgd                      # params -> torch.optim.Optimizer
    loss: Callable = default_loss                   # (model, inputs, targets) -> scalar mean loss
    dtype: torch.dtype = torch.float32
    name: str = ""

    @property
    def steps(self) -> int:
        return len(self.batches)


@dataclass
class RunResult:
    """What one rank (or the reference) saw: the loss at each step and the final full parameters."""
    losses: list | None = None                      # [float] per step, or None where not computed
    params: dict = field(default_factory=dict)      # {reference name: full tensor}



# ----------------------------------------------------------------------------------------------------
# Ready-made recipes for the reference models
# ----------------------------------------------------------------------------------------------------

def gpt_recipe(steps: int = 3, batch_size: int = 8, seq_len: int = 16, optimizer: str = "adam",
               seed: int = 0, **cfg_changes) -> Recipe:
    """The tiny GPT on :func:`minipar.datasets.markov_tokens`, ``steps`` global batches of ``batch_size``."""

    cfg = GPTConfig(**cfg_changes)
    tokens = markov_tokens(4096, cfg.vocab_size, seed=seed)
    batches = lm_batches(tokens, batch_size, seq_len, steps, seed=seed)
    return Recipe(model=lambda: TinyGPT(cfg, seed=seed), batches=batches, optimizer=_optimizer(optimizer),
                  name=f"TinyGPT {cfg.n_layer}L/{cfg.n_embd}h, {optimizer}")


def mlp_recipe(steps: int = 3, batch_size: int = 16, sizes=(16, 64, 64, 8), optimizer: str = "sgd",
               seed: int = 0) -> Recipe:
    """The MLP on :func:`minipar.datasets.regression_batches`."""

    batches = regression_batches(batch_size, sizes[0], sizes[-1], steps, seed=seed)
    return Recipe(model=lambda: MLP(sizes, seed=seed), batches=batches, optimizer=_optimizer(optimizer),
                  name=f"MLP {list(sizes)}, {optimizer}")


def _optimizer(name: str) -> Callable:
    if name == "sgd":
        return _sgd
    if name == "adam":
        return _adam
    raise ValueError(f"unknown optimizer {name!r}; use 'sgd' or 'adam'")


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)

"""Dynamic loss scaling: multiply the loss by S so that small FP16 gradients do not flush to zero.

Backpropagation is linear in the loss, so every gradient is multiplied by S too and lands in FP16's range
(FP16 flushes anything below 2^-24 ≈ 6e-8 to zero). Before the optimizer uses them the gradients are divided
by S again (in FP32). If S is too large a gradient overflows to inf (or a NaN appears): the step is skipped
and S is backed off. After ``growth_interval`` clean steps in a row S is grown again, so S hovers just below
the largest value that does not overflow (Micikevicius et al. 2018, "Mixed Precision Training", §3.2;
the dynamic policy of the same paper's follow-up work and of ``torch.amp.GradScaler``)::

    overflow:  skip the step;  S <- S · backoff_factor;  good_steps <- 0
    clean:     step;  good_steps += 1;  if good_steps == growth_interval: S <- S · growth_factor, good_steps <- 0

With data parallelism or sharded gradients every rank must take the same decision, so the overflow flag
is all-reduced (MAX) over ``group`` before anyone steps.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["DynamicLossScaler", "found_inf"]


def found_inf(grads) -> bool:
    """True if any gradient holds an inf or a NaN (one reduction per tensor, no copies)."""
    return any(not bool(torch.isfinite(g).all()) for g in grads if g is not None)


class DynamicLossScaler:
    """``scale(loss)`` before backward; ``unscale_(grads)`` and ``update(found)`` after it.

    ``history`` keeps one (scale used, overflow found, stepped) tuple per step, for the chapter's table.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group=None):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                             f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        self.loss_scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.group = group
        self.good_steps = 0
        self.history: list = []

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale

    def check_overflow(self, grads) -> bool:
        """Local inf/NaN test, agreed across ``group`` (if one was given) with an all-reduce of the flag."""
        flag = found_inf(grads)
        if self.group is not None:      # pass dist.group.WORLD (or a DP group) when gradients are sharded
            t = torch.tensor([float(flag)])
            comm.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            flag = bool(t.item())
        return flag

    def unscale_(self, grads) -> None:
        """Divide the gradients by the scale, in place (do it on FP32 copies: S^-1 · g may underflow FP16)."""
        inv = 1.0 / self.loss_scale
        for g in grads:
            if g is not None:
                g.mul_(inv)

    def update(self, overflow: bool) -> bool:
        """Record the step's outcome and move the scale. Returns True if the optimizer should step."""
        self.history.append((self.loss_scale, overflow, not overflow))
        if overflow:
            self.loss_scale *= self.backoff_factor
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = self.loss_scale * self.growth_factor
            if math.isfinite(grown):        # never grow into inf (the scale itself is an FP32 number)
                self.loss_scale = grown
            self.good_steps = 0
        return True

    def step(self, optimizer: torch.optim.Optimizer, grads=None) -> bool:
        """Check, unscale and step ``optimizer`` unless the gradients overflowed; then update the scale.

        ``grads`` defaults to the ``.grad`` of the optimizer's parameters (which must be FP32 master copies).
        """
        if grads is None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        overflow = self.check_overflow(grads)
        if not overflow:
            self.unscale_(grads)
            optimizer.step()
        return self.update(overflow)

    def state_dict(self) -> dict:
        return {"loss_scale": self.loss_scale, "good_steps": self.good_steps}


class ScaledOptimizer:
    """An optimizer that lets ``scaler`` decide: check (agreed over the scaler's group), unscale, step or
    skip. For strategies that call ``optimizer.step()`` themselves, such as ZeRO over FP32 master shards:
    each rank sees only its shard's gradients, so the overflow flag must be all-reduced."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: DynamicLossScaler):
        self.optimizer, self.scaler = optimizer, scaler

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self) -> bool:
        return self.scaler.step(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

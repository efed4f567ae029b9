"""Mixed-precision training from scratch: FP32 master weights, 16-bit compute, (dynamic) loss scaling.

Micikevicius et al. 2018, "Mixed Precision Training". One step:

    1. forward and backward run on a 16-bit copy of the model (half the bytes, the fast tensor-core path);
       the logits are cast to FP32 before the loss (softmax and log in FP32, as autocast does);
    2. FP16 only: the loss is multiplied by the loss scale S before backward, so small gradients survive;
    3. the 16-bit gradients are copied up to FP32 master gradients and divided by S there;
       an inf/NaN among them means S was too large: skip the step, back off S (see ``loss_scaler``);
    4. the optimizer, which only ever saw the FP32 master weights, updates them in FP32;
    5. the master weights are rounded down into the 16-bit copy for the next step.

Why master weights: an update u smaller than half the gap between w and its neighbour vanishes in w + u.
In FP16 that gap is 2^(floor(log2 |w|) - 10), so u is lost once |w/u| passes a threshold between 2^11 and
2^12 that depends on where w sits between two powers of two (BF16: 2^8 to 2^9; measured by
:func:`minipar.precision.formats.vanishing_ratio`); in FP32 only past 2^24.
BF16 has FP32's exponent range, so gradients do not underflow and no loss scaling is needed.

Memory per parameter with Adam: 2 (16-bit weight) + 2 (16-bit grad) + 4 (master) + 8 (Adam m, v) = 16
bytes, ZeRO's "2 + 2 + 12" — as many as FP32 Adam's 4 + 4 + 8; here the FP32 master gradient (4 more) also
exists during the step. What 16 bits halve is the activations and the gradient bytes on the wire.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..recipe import Recipe, RunResult
from ..data.ddp import DistributedDataParallel
from ..data.zero import ZeRO, block_units
from ..data.zero_measure import measured_zero_state_bytes
from ..loop import lm_loss, mean_over_ranks, shard_batch
from ..models import MLP
from .loss_scaler import DynamicLossScaler, ScaledOptimizer

__all__ = ["MixedPrecision", "fp32_loss", "train_mixed", "underflow_fraction", "small_gradient_case",
           "ddp_parallel_train", "zero_parallel_train", "MixedRunResult"]

COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fp32_loss(model: nn.Module, inputs, targets) -> torch.Tensor:
    """The recipe's loss with the model output cast to FP32 first (cross-entropy or MSE in FP32).
    Floating inputs are cast to the model's dtype (token ids stay integers)."""
    if inputs.is_floating_point():
        inputs = inputs.to(next(model.parameters()).dtype)
    out = model(inputs).float()
    if targets.dtype == torch.long:
        return lm_loss(out, targets)
    return F.mse_loss(out, targets.float())


class MixedPrecision:
    """Hold an FP32 master copy of ``model``'s parameters (owned by the optimizer) and turn ``model``
    itself into the 16-bit compute copy.

    ``scaler``: ``"auto"`` = a :class:`DynamicLossScaler` for FP16 and none for BF16/FP32; ``None`` = no
    scaling (to show FP16's underflow); or a scaler you configured.
    """

    def __init__(self, model: nn.Module, optimizer: Callable, dtype: torch.dtype = torch.float16,
                 scaler="auto"):
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
        self.dtype = dtype
        self.names = [n for n, _ in model.named_parameters()]
        self.master = [nn.Parameter(p.detach().clone().float()) for p in model.parameters()]
        self.optimizer = optimizer(self.master)          # the optimizer never sees a 16-bit tensor
        self.model = model.to(dtype)                     # the compute copy (same module, cast in place)
        self.compute = list(model.parameters())
        self.scaler = (DynamicLossScaler() if dtype == torch.float16 else None) if scaler == "auto" else scaler

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the 16-bit model, with the loss multiplied by the loss scale if there is one."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def copy_grads_up(self) -> list:
        """16-bit gradients -> FP32 master gradients (still scaled); the 16-bit ones are released."""
        for master, p in zip(self.master, self.compute):
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        return [m.grad for m in self.master]

    def step(self) -> bool:
        """Steps 3-5 above. Returns False if the step was skipped because of an overflow."""
        grads = self.copy_grads_up()
        if self.scaler is not None:
            stepped = self.scaler.step(self.optimizer, grads)   # checks, unscales in FP32, steps or skips
        else:
            self.optimizer.step()
            stepped = True
        if stepped:
            self.copy_weights_down()
        self.optimizer.zero_grad(set_to_none=True)
        return stepped

    @torch.no_grad()
    def copy_weights_down(self) -> None:
        for master, p in zip(self.master, self.compute):
            p.copy_(master)                                 # rounds to the nearest 16-bit value

    def train_step(self, loss_fn: Callable, *batch, module: nn.Module | None = None) -> tuple:
        """One optimizer step: returns (loss as a float, whether the step was taken). ``module``: what to
        run forward instead of the bare model, e.g. the DDP wrapper around it."""
        loss = loss_fn(module if module is not None else self.model, *batch)
        self.backward(loss)
        return loss.item(), self.step()

    def master_params(self) -> dict:
        return {n: m.detach().clone() for n, m in zip(self.names, self.master)}


def train_mixed(recipe: Recipe, dtype: torch.dtype = torch.float16, scaler="auto") -> tuple:
    """Train ``recipe`` with mixed precision on one device. Returns (RunResult with the FP32 master
    parameters, the :class:`MixedPrecision` object for its scaler history)."""
    mp = MixedPrecision(recipe.model(), recipe.optimizer, dtype, scaler)
    losses = [mp.train_step(fp32_loss, x, y)[0] for x, y in recipe.batches]
    return RunResult(losses, mp.master_params()), mp


def underflow_fraction(grads_16bit, grads_fp32) -> float:
    """Fraction of gradient values that are non-zero in FP32 but exactly zero in 16 bits (flushed)."""
    g16 = torch.cat([g.flatten() for g in grads_16bit])
    g32 = torch.cat([g.flatten() for g in grads_fp32])
    lost = (g16 == 0) & (g32 != 0)
    return float(lost.sum()) / max(int((g32 != 0).sum()), 1)


def small_gradient_case(residual: float = 1e-4, seed: int = 0, sizes=(32, 128, 128, 128, 1)) -> tuple:
    """A regression MLP that is nearly fitted: targets = its own output + ``residual``-sized noise, so its
    gradients are mostly below FP16's smallest subnormal 2^-24 (the case the loss scale exists for).
    Returns (model factory, x, y)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, sizes[0], generator=g)
    with torch.no_grad():
        y = MLP(sizes, seed=seed)(x) + residual * torch.randn(256, sizes[-1], generator=g)
    return (lambda: MLP(sizes, seed=seed)), x, y


# ----------------------------------------------------------------------------------------------------
# With data parallelism: DDP all-reduces the 16-bit gradients; ZeRO shards the FP32 masters
# ----------------------------------------------------------------------------------------------------

class MixedRunResult(RunResult):
    """A :class:`RunResult` plus the loss scaler's history [(scale, overflow, stepped)] on this rank and,
    for ZeRO, its model-state bytes after the run ({"params", "grads", "optimizer"})."""

    def __init__(self, losses, params, scaler_history=None, state_bytes=None):
        super().__init__(losses, params)
        self.scaler_history = list(scaler_history or [])
        self.state_bytes = dict(state_bytes or {})


def ddp_parallel_train(rank, world_size, recipe, dtype=torch.float16, scaler="auto", group=None,
                       step_log: "comm.CommLog | None" = None) -> RunResult:
    """Mixed precision under :class:`minipar.data.ddp.DistributedDataParallel` with ``comm_dtype=dtype``:
    every rank keeps FP32 masters, the buckets of 16-bit (scaled) gradients are all-reduced in 16 bits —
    2·2Ψ·(N-1)/N bytes sent per rank and step instead of 2·4Ψ·(N-1)/N. The averaged gradients are the same
    on every rank, so every rank's scaler takes the same decision without talking."""
    if isinstance(scaler, dict):                 # scaler settings (a scaler cannot be built before launch)
        scaler = DynamicLossScaler(**scaler)
    mp = MixedPrecision(recipe.model(), recipe.optimizer, dtype, scaler)
    ddp = DistributedDataParallel(mp.model, group, comm_dtype=dtype)
    losses = []
    for batch in recipe.batches:
        x, y = shard_batch(batch, rank, world_size)
        with comm.recording(step_log if step_log is not None else comm.CommLog()):
            loss, _ = mp.train_step(fp32_loss, x, y, module=ddp)
        losses.append(mean_over_ranks(torch.tensor(loss, dtype=torch.float64), group))
    return MixedRunResult(losses, mp.master_params(), mp.scaler.history if mp.scaler is not None else [])


def zero_parallel_train(rank, world_size, recipe, dtype=torch.float16, stage: int = 2, scaler="auto",
                        group=None, step_log: "comm.CommLog | None" = None) -> RunResult:
    """Mixed precision under :class:`minipar.data.zero.ZeRO` with ``param_dtype=dtype``: 16-bit compute
    copies and collectives, FP32 master shards and optimizer state (1/N each). The loss scaler wraps the
    optimizer over the shards; its overflow flag is all-reduced because each rank sees only its shard."""
    if scaler == "auto":
        scaler = {} if dtype == torch.float16 else None
    if isinstance(scaler, dict):                 # settings: the group only exists inside the rank
        scaler = DynamicLossScaler(group=group or dist.group.WORLD, **scaler)
    model = recipe.model()

    def optimizer(shards):
        inner = recipe.optimizer(shards)
        return ScaledOptimizer(inner, scaler) if scaler is not None else inner
    zero = ZeRO(model, optimizer, stage, group, block_units(model), param_dtype=dtype)
    losses = []
    for batch in recipe.batches:
        x, y = shard_batch(batch, rank, world_size)
        with comm.recording(step_log if step_log is not None else comm.CommLog()):
            zero.zero_grad()
            loss = fp32_loss(model, x, y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            zero.step()
        losses.append(mean_over_ranks(torch.tensor(loss.item(), dtype=torch.float64), group))
    return MixedRunResult(losses, zero.full_parameters(), scaler.history if scaler is not None else [],
                          measured_zero_state_bytes(zero))

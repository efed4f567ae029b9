"""PowerSGD: data parallelism that all-reduces a rank-r approximation of each gradient matrix instead of
the matrix (Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", Algorithm 1, with error feedback and warm start).

Per gradient matrix M (n×m; a tensor of more dimensions is viewed as (shape[0], -1)) on rank i, with this
rank's error e_i (zero at first) and Q (m×r), warm-started from the previous step (at first random,
drawn from the same seed on every rank)::

    M_i ← g_i + e_i                         error feedback: what earlier steps failed to send
    P   = (1/N) Σ_i M_i Q                   all-reduce P: n·r numbers
    P̂   = orthonormal basis of P's columns  (QR)
    Q   = (1/N) Σ_i M_iᵀ P̂                  all-reduce Q: m·r numbers
    M̂   = P̂ Qᵀ  =  P̂ P̂ᵀ (1/N) Σ_i M_i        the same on every rank: the gradient the optimizer sees
    e_i ← M_i − M̂                           local: what this rank's gradient lost (Σ_i e_i stays 0 at full rank)

A matrix is compressed only when that saves bytes, (n+m)·r·``min_compression_rate`` < n·m, as in
PyTorch's ``powerSGD_hook`` (rate 1: any saving); 1-D tensors (biases, norms) and the other matrices are
all-reduced as they are. Bytes sent per rank per step, ring all-reduce, b bytes per element::

    2(N−1)/N · b · ( Σ_compressed (n+m)·r  +  Σ_uncompressed numel )      — :func:`powersgd_bytes`

against DDP's 2(N−1)/N · b · Σ numel. One step is three all-reduces (the Ps, the Qs, the uncompressed
tensors, each packed flat so a rank pays the latency once per kind). It is not synchronous training: at
low rank the update is not the mean gradient; :func:`powersgd_reference` is the rule in one process, and
:func:`torch_hook_run` trains the same recipe with PyTorch's DDP + ``powerSGD_hook`` beside it.
(PyTorch also orthogonalizes the warm-started Q before P = MQ; span(MQ) does not change, so neither does M̂.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import comm
from ..recipe import RunResult
from ..launcher import launch
from ..loop import mean_over_ranks, shard_batch
from .. import wire
from ..validation import positive_int

__all__ = ["PowerSGDReducer", "PowerSGDRun", "compressible", "powersgd_bytes", "validate", "parallel_train",
           "run", "powersgd_reference", "torch_hook_run"]


def compressible(shape, rank_r: int, min_compression_rate: float = 1.0) -> bool:
    """True when a gradient of ``shape`` is sent as P and Q: a matrix whose (n+m)·r·rate < n·m."""
    n, m = (shape[0], int(torch.Size(shape[1:]).numel())) if len(shape) >= 2 else (0, 0)
    return len(shape) >= 2 and (n + m) * min(n, m, rank_r) * min_compression_rate < n * m


def powersgd_bytes(shapes, rank_r: int, n_ranks: int, elem_bytes: int, min_compression_rate: float = 1.0) -> float:
    """Bytes one rank sends per PowerSGD step for gradients of ``shapes`` on ``n_ranks`` (ring all-reduce)."""
    numbers = 0
    for shape in shapes:
        if compressible(shape, rank_r, min_compression_rate):
            n, m = shape[0], int(torch.Size(shape[1:]).numel())
            numbers += (n + m) * min(n, m, rank_r)               # P and Q
        else:
            numbers += int(torch.Size(shape).numel())            # the tensor itself
    return comm.predicted_bytes_sent("all_reduce", numbers * elem_bytes, n_ranks)


def orthonormal_columns(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of ``p``'s columns (Householder QR: stable even when ``p`` is rank-deficient)."""
    return torch.linalg.qr(p).Q


def initial_qs(shapes, rank_r: int, seed: int, dtype) -> list:
    """The first Q (m×r) of each compressed matrix: N(0, 1) from ``seed``, the same on every rank."""
    g = torch.Generator().manual_seed(seed)             # drawn in float64 so every dtype sees the same Q
    return [torch.randn(m, min(n, m, rank_r), generator=g, dtype=torch.float64).to(dtype) for n, m in shapes]


class PowerSGDReducer:
    """Replaces every ``param.grad`` of ``params`` with its PowerSGD mean over ``group``. Call
    :meth:`reduce` after ``loss.backward()`` and before ``optimizer.step()``. The first ``start_step``
    steps all-reduce everything uncompressed (PyTorch's ``start_powerSGD_iter``); error feedback starts then."""

    def __init__(self, params, rank_r: int, group=None, *, seed: int = 0, min_compression_rate: float = 1.0,
                 error_feedback: bool = True, start_step: int = 0):
        positive_int("rank_r", rank_r)
        params = [p for p in params if p.requires_grad]
        self.group, self.error_feedback, self.start_step = group, error_feedback, start_step
        self.matrices = [p for p in params if compressible(p.shape, rank_r, min_compression_rate)]
        self.uncompressed = [p for p in params if not compressible(p.shape, rank_r, min_compression_rate)]
        shapes = [(p.shape[0], p.numel() // p.shape[0]) for p in self.matrices]
        self.qs = initial_qs(shapes, rank_r, seed, params[0].dtype if params else torch.float32)
        self.errors = [torch.zeros(s, dtype=p.dtype) for s, p in zip(shapes, self.matrices)]
        self.steps = 0

    def reduce(self) -> None:
        for p in self.matrices + self.uncompressed:
            if p.grad is None:                                   # unused on this rank: it contributes zeros
                p.grad = torch.zeros_like(p)
        if self.steps < self.start_step:                         # warm-up: plain all-reduce of everything
            self._all_reduce_mean([p.grad for p in self.matrices + self.uncompressed])
            self.steps += 1
            return
        n_ranks = dist.get_world_size(self.group)
        ms = [p.grad.reshape(p.shape[0], -1) + (e if self.error_feedback else 0)
              for p, e in zip(self.matrices, self.errors)]
        ps = [m @ q for m, q in zip(ms, self.qs)]
        comm.all_reduce_flat(ps, group=self.group)               # all-reduce P: n·r per matrix
        ps = [orthonormal_columns(p / n_ranks) for p in ps]
        qs = [m.T @ p for m, p in zip(ms, ps)]
        comm.all_reduce_flat(qs, group=self.group)               # all-reduce Q: m·r per matrix
        self.qs = [q / n_ranks for q in qs]                      # warm start: next step's Q
        for i, (param, m, p, q) in enumerate(zip(self.matrices, ms, ps, self.qs)):
            approx = p @ q.T                                     # M̂, the same on every rank
            if self.error_feedback:
                self.errors[i] = m - approx                      # local: what this rank's M lost
            param.grad.copy_(approx.view_as(param.grad))
        self._all_reduce_mean([p.grad for p in self.uncompressed])   # biases, norms, small matrices
        self.steps += 1

    def _all_reduce_mean(self, grads: list) -> None:
        comm.all_reduce_flat(grads, group=self.group)            # one flat all-reduce, summed ...
        for g in grads:
            g.div_(dist.get_world_size(self.group))              # ... then the mean


@dataclass
class PowerSGDRun(RunResult):
    """A :class:`RunResult` plus the bytes this rank sent in each step's reduction: as :mod:`minipar.comm`
    modelled them (``bytes_sent``) and as its sockets carried them (``wire_bytes``, None where unknown)."""
    bytes_sent: list = field(default_factory=list)
    wire_bytes: list = field(default_factory=list)


def validate(recipe, *, world_size: int, rank_r: int, **_) -> None:
    """Raise ValueError, before any process starts, for a configuration that cannot run."""
    positive_int("rank_r", rank_r)
    positive_int("world_size", world_size)
    if world_size < 2:
        raise ValueError("PowerSGD compresses the all-reduce between ranks; with world_size 1 there is none "
                         "(use minipar.check.train_reference)")
    for step, (inputs, _) in enumerate(recipe.batches):
        if inputs.shape[0] % world_size:
            raise ValueError(f"global batch {step} has {inputs.shape[0]} rows: not divisible by {world_size} ranks")


def parallel_train(rank: int, world_size: int, recipe, *, rank_r: int, seed: int = 0,
                   min_compression_rate: float = 1.0, error_feedback: bool = True, start_step: int = 0,
                   group=None) -> PowerSGDRun:
    """Train ``recipe`` data-parallel with PowerSGD at rank ``rank_r``; each rank takes 1/N of every batch.
    Only the reducer's communication is counted (not the loss reported for the table)."""
    validate(recipe, world_size=world_size, rank_r=rank_r)
    model = recipe.model().to(recipe.dtype)
    opt = recipe.optimizer(model.parameters())
    reducer = PowerSGDReducer(model.parameters(), rank_r, group, seed=seed, start_step=start_step,
                              min_compression_rate=min_compression_rate, error_feedback=error_feedback)
    result = PowerSGDRun(losses=[])
    for batch in recipe.batches:
        x, y = shard_batch(batch, rank, world_size)
        opt.zero_grad(set_to_none=True)
        loss = recipe.loss(model, x, y)
        loss.backward()
        with comm.recording() as log:
            reducer.reduce()
        opt.step()
        result.bytes_sent.append(log.bytes_sent)
        result.wire_bytes.append(log.observed_bytes_sent)
        result.losses.append(mean_over_ranks(loss.detach().double(), group))
    result.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return result


def run(recipe, *, world_size: int, rank_r: int, quiet: bool = True, **config) -> list:
    """Check the inputs, then :func:`parallel_train` on ``world_size`` ranks: per-rank PowerSGDRuns."""
    validate(recipe, world_size=world_size, rank_r=rank_r)
    return launch(parallel_train, world_size, recipe, rank_r=rank_r, quiet=quiet, **config)


def powersgd_reference(recipe, world_size: int, rank_r: int, *, seed: int = 0, min_compression_rate: float = 1.0,
                       error_feedback: bool = True, start_step: int = 0) -> RunResult:
    """The same rule in one process: each step the N shards' gradients are computed one after the other,
    and P and Q are averaged by a plain mean over them — no process, no collective."""
    validate(recipe, world_size=world_size, rank_r=rank_r)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                                     # as every rank runs: the same kernels' sums
    try:
        model = recipe.model().to(recipe.dtype)
        opt = recipe.optimizer(model.parameters())
        params = [p for p in model.parameters() if p.requires_grad]
        matrices = [p for p in params if compressible(p.shape, rank_r, min_compression_rate)]
        shapes = [(p.shape[0], p.numel() // p.shape[0]) for p in matrices]
        qs = initial_qs(shapes, rank_r, seed, recipe.dtype)
        errors = [[torch.zeros(s, dtype=recipe.dtype)] * world_size for s in shapes]   # errors[k][i]: rank i's
        losses = []
        for step, batch in enumerate(recipe.batches):
            grads, step_losses = [], []                          # grads[i][p]: rank i's gradient
            for i in range(world_size):
                x, y = shard_batch(batch, i, world_size)
                opt.zero_grad(set_to_none=True)
                loss = recipe.loss(model, x, y)
                loss.backward()
                step_losses.append(loss.detach().double())
                grads.append({p: p.grad.clone() for p in params})
            losses.append((sum(step_losses) / world_size).item())
            for p in params:                                     # start from the plain mean of every gradient
                p.grad = sum(g[p] for g in grads) / world_size
            if step >= start_step:
                for k, p in enumerate(matrices):
                    ms = [g[p].reshape(shapes[k]) + (errors[k][i] if error_feedback else 0)
                          for i, g in enumerate(grads)]
                    pk = orthonormal_columns(sum(m @ qs[k] for m in ms) / world_size)
                    qs[k] = sum(m.T @ pk for m in ms) / world_size
                    approx = pk @ qs[k].T
                    errors[k] = [m - approx for m in ms]
                    p.grad = approx.view_as(p).clone()
            opt.step()
        return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    finally:
        torch.set_num_threads(threads)


def _torch_hook_train(rank, world_size, recipe, rank_r, start_step, min_compression_rate):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    model = recipe.model().to(recipe.dtype)
    ddp = TorchDDP(model, bucket_cap_mb=1024)                    # one bucket, like minipar's flat packs
    state = hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r, use_error_feedback=True,
                               warm_start=True, start_powerSGD_iter=start_step,
                               min_compression_rate=min_compression_rate)
    ddp.register_comm_hook(state, hook.powerSGD_hook)
    opt = recipe.optimizer(ddp.parameters())
    result = PowerSGDRun(losses=[])
    for batch in recipe.batches:
        x, y = shard_batch(batch, rank, world_size)
        opt.zero_grad(set_to_none=True)
        loss = recipe.loss(ddp, x, y)
        with wire.observing() as seen:                           # the hook's all-reduces run inside backward
            loss.backward()
        opt.step()
        result.wire_bytes.append(seen.bytes_sent)
        result.losses.append(mean_over_ranks(loss.detach().double()))
    result.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return result


def torch_hook_run(recipe, world_size: int, rank_r: int, *, start_step: int = 2,
                   min_compression_rate: float = 1.0) -> PowerSGDRun:
    """Rank 0's run of ``recipe`` trained by PyTorch's DDP with ``powerSGD_hook`` (error feedback, warm start;
    PyTorch requires ``start_powerSGD_iter`` >= 2 with them): losses, parameters and the bytes its sockets
    carried per step (``wire_bytes``; ``bytes_sent`` stays empty: the hook bypasses :mod:`minipar.comm`), for
    :func:`run` with the same ``start_step`` beside it. Not bit-equal: the hook draws its first Q elsewhere."""
    validate(recipe, world_size=world_size, rank_r=rank_r)
    if start_step < 2:
        raise ValueError(f"PyTorch's powerSGD_hook needs start_step >= 2 with error feedback, got {start_step}")
    return launch(_torch_hook_train, world_size, recipe, rank_r, start_step, min_compression_rate, quiet=True)[0]

"""Collective matmul (async tensor parallelism): sequence parallelism's all-gather and reduce-scatter cut into
p send/recv steps, each hidden under one shard's GEMM.

Sources: Wang et al. 2022, "Overlap Communication with Dependent Computation via Decomposition in Large Deep
Learning Models" (ASPLOS '23); How to Scale Your Model (Austin et al.), "collective matmul"; PyTorch's async TP
(``torch.distributed._symmetric_memory``'s ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``, which
torchtitan turns on with ``enable_async_tensor_parallel``).

On a tensor-parallel group of p ranks, activations (b, s, h) are split along the sequence (dim 1) into blocks
X = [X_0; …; X_{p−1}]; rank r holds X_r and the column-parallel weight W_r (PyTorch layout, out × in). All
rings are **unidirectional**: rank r sends to r+1 and receives from r−1 (mod p). Wang et al. also describe a
bidirectional ring (half the steps, both links busy); one direction is the plainest to follow.

**All-gather + GEMM** (the column-parallel layer, :func:`all_gather_matmul`)::

    Y_r = [X_0; …; X_{p−1}] W_rᵀ,   so row block j of Y_r is X_j W_rᵀ.
    step k = 0 … p−1:  rank r holds X_(r−k); it starts sending X_(r−k) to r+1 and receiving X_(r−k−1)
                       from r−1, computes Y_r[r−k] = X_(r−k) W_rᵀ meanwhile, then waits.   (indices mod p)

**GEMM + reduce-scatter** (the row-parallel layer, :func:`matmul_reduce_scatter`), input Y_r (b, s, n/p) and
weight V_r (h, n/p)::

    Z[j] = Σ_i Y_i[j] V_iᵀ, rank r keeps Z[r].
    step k = 0 … p−1, j = r−k−1:  rank r starts sending the partial sum it finished at step k−1 (block j+1) to
                       r+1 and receiving the partial of block j from r−1, computes its own term Y_r[j] V_rᵀ
                       meanwhile, waits, and adds. At step p−1, j = r: Z[r] is complete.

Each is p−1 messages of one block per rank: exactly the ring all-gather's / reduce-scatter's (p−1)/p · S bytes,
with the same order of additions as :func:`minipar.comm.ring_reduce_scatter`, and the transfer of step k travels
while the GEMM of step k runs. Inside ``comm.ring_algorithms()`` the results are therefore bit-identical to the
blocking SP layers' wherever PyTorch's GEMM computes a block of rows exactly as it computes them within the whole
(seen on CPU for contiguous rows, ≥ 4 per block; a small-M kernel, or the blocking layer's sequence-major view
of its gathered input at batch > 1, may round an element differently: then equal to rounding).

**Backward.** The conjugates swap: the backward of all-gather + GEMM needs dX_r = [Σ_i dY_i W_i][r] (GEMM +
reduce-scatter) and dW_r = dY_rᵀ X (needs X gathered: an all-gather); the backward of GEMM +
reduce-scatter is dY_r = [dZ_0; …; dZ_{p−1}] V_r, an all-gather + GEMM, done with the forward's ring, which
leaves the gathered dZ for dV_r = dZᵀ Y_r. For the column layer this module does what Megatron-LM's sequence
parallelism does (``LinearWithGradAccumulationAndAsyncCommunication``): **the all-gather of X under the dX GEMM,
the reduce-scatter of dX under the dW GEMM** — not the all-gather under the dW GEMM, which needs the gathered X::

    1. post the all-gather of X_r (p−1 isends to the peers, p−1 irecvs)  |  dX_partial = dY W_r   (GEMM)
    2. wait; post the reduce-scatter of dX_partial (block j to rank j)    |  dW_r = dYᵀ X           (GEMM)
    3. wait; dX_r = Σ of the p blocks r, added in the ring's order.

On gloo both phases are posted whole (isend/irecv to every peer: the same p−1 messages of one block as the
ring, so the same bytes), so nothing blocks between them. What is left without a transfer under it is compute:
the last GEMM of the all-gather ring, the first of the reduce-scatter ring, and the dV GEMM of the row layer's
backward (its all-gather already rode the ring). A transfer slower than its GEMM stays partly exposed.

Timelines: pass a list as ``timeline`` (or set a layer's ``timeline``) and every step appends
``(phase, event, step, time.perf_counter())`` with events ``send_start``, ``matmul_start``, ``matmul_end``,
``wait_end``: the schedule as it really ran on this rank.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from .layers import ColumnParallelLinear, RowParallelLinear
from .operators import SEQ_DIM

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "AllGatherMatmul", "MatmulReduceScatter",
           "CollectiveMatmulColumnLinear", "CollectiveMatmulRowLinear", "use_collective_matmul"]


def _ring(group) -> tuple:
    """(global ranks of ``group`` in group order, my index, p); a ValueError for a group of one rank."""
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    if len(ranks) < 2:
        raise ValueError(f"collective matmul needs a tensor-parallel group of at least 2 ranks, got {len(ranks)}: "
                         "on one rank there is nothing to overlap (use nn.Linear)")
    return ranks, ranks.index(dist.get_rank()), len(ranks)


def _mark(timeline, phase, event, step):
    if timeline is not None:
        timeline.append((phase, event, step, time.perf_counter()))


def _check_sequence(x: torch.Tensor, p: int = 1) -> None:
    """A ValueError unless ``x`` is (batch, sequence, ...) with a sequence length divisible by ``p``."""
    if x.dim() <= SEQ_DIM:
        raise ValueError(f"collective matmul takes (batch, sequence, features) activations, got shape {tuple(x.shape)}")
    if x.shape[SEQ_DIM] % p:
        raise ValueError(f"the sequence length {x.shape[SEQ_DIM]} of a {tuple(x.shape)} input is not divisible by "
                         f"the tensor-parallel degree {p}")


def _contiguous_blocks(x: torch.Tensor, p: int) -> list:
    """``x`` cut into p equal blocks along the sequence, each contiguous (a send's buffer must be)."""
    _check_sequence(x, p)
    return [block.contiguous() for block in x.chunk(p, dim=SEQ_DIM)]


def all_gather_matmul(x_shard, weight, bias, group, timeline=None, phase="all_gather_matmul"):
    """``F.linear(all-gather of x_shard along the sequence, weight, bias)`` in p ring steps (module docstring).
    Returns (Y, the gathered input): every shard passed through this rank, so the gather comes free. Every
    rank's shard must have the same shape (its sequence is the whole one divided by p)."""
    ranks, me, p = _ring(group)
    _check_sequence(x_shard)
    right, left = ranks[(me + 1) % p], ranks[(me - 1) % p]
    held = x_shard.contiguous()                    # isend/irecv move whole contiguous buffers
    y_blocks, x_blocks = [None] * p, [None] * p
    for k in range(p):
        j = (me - k) % p                           # the block held at step k
        requests = []
        if k < p - 1:                              # start passing it on before multiplying it: the overlap
            incoming = torch.empty_like(held)
            _mark(timeline, phase, "send_start", k)
            requests = [comm.isend(held, right, group), comm.irecv(incoming, left, group)]
        _mark(timeline, phase, "matmul_start", k)
        y_blocks[j], x_blocks[j] = F.linear(held, weight, bias), held
        _mark(timeline, phase, "matmul_end", k)
        for request in requests:
            request.wait()
        if requests:
            _mark(timeline, phase, "wait_end", k)
            held = incoming
    return torch.cat(y_blocks, dim=SEQ_DIM), torch.cat(x_blocks, dim=SEQ_DIM)


def matmul_reduce_scatter(y, weight, group, timeline=None, phase="matmul_reduce_scatter"):
    """This rank's sequence block of ``Σ_ranks F.linear(y, weight)`` (no bias) in p ring steps: a partial
    sum travels while the next term is computed (module docstring)."""
    ranks, me, p = _ring(group)
    right, left = ranks[(me + 1) % p], ranks[(me - 1) % p]
    y_blocks = _contiguous_blocks(y, p)
    partial = None
    for k in range(p):
        j = (me - k - 1) % p                       # the block this step adds to; j = me at the last step
        requests = []
        if k > 0:                                  # the partial of step k−1 leaves while this step's term is made
            incoming = torch.empty_like(partial)
            _mark(timeline, phase, "send_start", k)
            requests = [comm.isend(partial, right, group), comm.irecv(incoming, left, group)]
        _mark(timeline, phase, "matmul_start", k)
        term = F.linear(y_blocks[j], weight)
        _mark(timeline, phase, "matmul_end", k)
        for request in requests:
            request.wait()
        if requests:
            _mark(timeline, phase, "wait_end", k)
        partial = term if k == 0 else term + incoming     # mine + what came: the ring's order
    return partial


def _post_exchange(send_blocks, recv_like, ranks, me, group) -> tuple:
    """Post one isend of ``send_blocks[i]`` (contiguous, kept alive by the caller until the wait) to rank i
    and one irecv from rank i, for every peer i, at once: a direct all-gather or reduce-scatter, the ring's
    p−1 messages of one block, none waiting on another. Returns (received blocks by group index, requests)."""
    received, requests = [None] * len(ranks), []
    for i, peer in enumerate(ranks):
        if i != me:
            received[i] = torch.empty_like(recv_like)
            requests += [comm.isend(send_blocks[i], peer, group), comm.irecv(received[i], peer, group)]
    return received, requests


class AllGatherMatmul(torch.autograd.Function):
    """``Y = AG(X_shard) Wᵀ + b`` as a collective matmul. Backward in Megatron's order: the all-gather of X
    under the dX GEMM, the reduce-scatter of dX under the dW GEMM. ``keep_gathered`` saves the gathered X (no
    all-gather in backward: t times the memory, TP's bytes), as :class:`ColumnParallelLinear` does."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, keep_gathered=False, timeline=None):
        x_shard = x_shard.contiguous()             # backward sends it as it is
        y, x = all_gather_matmul(x_shard, weight, bias, group, timeline)
        ctx.group, ctx.has_bias, ctx.keep_gathered, ctx.timeline = group, bias is not None, keep_gathered, timeline
        ctx.save_for_backward(x if keep_gathered else x_shard, weight)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        saved, weight = ctx.saved_tensors
        ranks, me, p = _ring(ctx.group)
        timeline, phase = ctx.timeline, "backward: all-gather under dX, reduce-scatter under dW"
        requests = []
        if not ctx.keep_gathered:                  # 1. all-gather X while the dX GEMM runs
            _mark(timeline, phase, "send_start", 0)
            x_blocks, requests = _post_exchange([saved] * p, saved, ranks, me, ctx.group)
            x_blocks[me] = saved
        _mark(timeline, phase, "matmul_start", 0)
        grad_x_partial = grad_y @ weight           # this rank's term of dX, for every token
        _mark(timeline, phase, "matmul_end", 0)
        for request in requests:
            request.wait()
        _mark(timeline, phase, "wait_end", 0)
        x = saved if ctx.keep_gathered else torch.cat(x_blocks, dim=SEQ_DIM)
        # 2. reduce-scatter dX while the dW GEMM runs
        terms = _contiguous_blocks(grad_x_partial, p)
        _mark(timeline, phase, "send_start", 1)
        received, requests = _post_exchange(terms, terms[me], ranks, me, ctx.group)
        _mark(timeline, phase, "matmul_start", 1)
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.has_bias else None
        _mark(timeline, phase, "matmul_end", 1)
        for request in requests:
            request.wait()
        _mark(timeline, phase, "wait_end", 1)
        grad_x = received[(me + 1) % p]            # summed as the ring sums: from rank me+1 round to me itself
        for i in range(2, p + 1):
            grad_x = (terms[me] if i == p else received[(me + i) % p]) + grad_x
        return grad_x, grad_w, grad_b, None, None, None


class MatmulReduceScatter(torch.autograd.Function):
    """``Z_r = [Σ_ranks Y Vᵀ][r]`` (no bias) as a collective matmul. Backward: dY = AG(dZ) V by the
    all-gather + GEMM ring, which leaves AG(dZ) behind for dV = AG(dZ)ᵀ Y (that GEMM is exposed)."""

    @staticmethod
    def forward(ctx, y, weight, group, timeline=None):
        ctx.group, ctx.timeline = group, timeline
        ctx.save_for_backward(y, weight)
        return matmul_reduce_scatter(y, weight, group, timeline)

    @staticmethod
    def backward(ctx, grad_z):
        y, weight = ctx.saved_tensors
        grad_y, grad_z_full = all_gather_matmul(grad_z, weight.t(), None, ctx.group, ctx.timeline,
                                                phase="backward: all-gather + GEMM for dY")
        grad_w = grad_z_full.reshape(-1, grad_z_full.shape[-1]).t() @ y.reshape(-1, y.shape[-1])
        return grad_y, grad_w, None, None


class CollectiveMatmulColumnLinear(ColumnParallelLinear):
    """A sequence-parallel :class:`ColumnParallelLinear` whose all-gather is decomposed into the GEMM (same
    parameters and shards; ``parts=3`` for a fused QKV). ``timeline``: a list to record the schedule in."""
    timeline = None

    def __init__(self, weight, bias, group, parts: int = 1):
        _ring(group)
        super().__init__(weight, bias, group, parts=parts, sequence_parallel=True)

    def forward(self, x_shard):
        return AllGatherMatmul.apply(x_shard, self.weight, self.bias, self.group, self.keep_gathered_input,
                                     self.timeline)


class CollectiveMatmulRowLinear(RowParallelLinear):
    """A sequence-parallel :class:`RowParallelLinear` whose reduce-scatter is decomposed into the GEMM. The
    bias is added after the sum, to this rank's tokens (its gradient needs
    :func:`minipar.tensor.sequence.sync_sequence_parallel_grads`, as under SP)."""
    timeline = None

    def __init__(self, weight, bias, group):
        _ring(group)
        super().__init__(weight, bias, group, input_is_parallel=True, sequence_parallel=True)

    def forward(self, x):
        z = MatmulReduceScatter.apply(x, self.weight, self.group, self.timeline)
        return z if self.bias is None else z + self.bias


def use_collective_matmul(module: nn.Module, timeline: list | None = None) -> nn.Module:
    """Make every sequence-parallel column- and row-parallel layer in ``module`` a collective matmul, in place:
    the same parameter objects (an optimizer built before keeps working), the same shards, only the forward and
    backward change. ``timeline``, if given, is shared by all of them. Returns ``module``."""
    swaps = {ColumnParallelLinear: CollectiveMatmulColumnLinear, RowParallelLinear: CollectiveMatmulRowLinear}
    for m in module.modules():
        twin = swaps.get(type(m))
        if twin is None or not m.sequence_parallel or getattr(m, "gather_output", False):
            continue
        if twin is CollectiveMatmulRowLinear and not m.input_is_parallel:
            continue
        _ring(m.group)
        m.__class__ = twin        # the twin adds no state: its class attribute ``timeline`` is the only default
        if timeline is not None:
            m.timeline = timeline
    return module

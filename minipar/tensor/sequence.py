"""Megatron sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models").

Under tensor parallelism (TP) the LayerNorms and dropouts run on the whole (b, s, h) activation on every
rank: ``sbh·10`` bytes per layer (16-bit) that TP does not divide. Sequence parallelism (SP) cuts those
regions along the sequence: each rank keeps s/t tokens. Where a column-parallel layer needs the whole
sequence, an **all-gather** (forward; reduce-scatter backward) replaces f; after a row-parallel layer a
**reduce-scatter** (forward; all-gather backward) replaces g. An all-reduce *is* a reduce-scatter followed
by an all-gather, so the bytes are the same: ``2(t-1)/t · sbh`` per rank per all-reduce either way.

Activation bytes per layer (a = heads, 16-bit activations, 1-byte dropout masks; the paper's eq. 2–4;
:func:`minipar.activations.activation_bytes_formula` counts them)::

    no parallelism    sbh (34 + 5as/h)
    TP                sbh (10 + 24/t + 5as/(ht))
    TP + SP           sbh (34/t + 5as/(ht))

The column-parallel layer under SP keeps only its input's sequence shard for backward and all-gathers it
again there (an extra all-gather per column-parallel layer in backward, which Megatron hides under the
input-gradient GEMM — the weight-gradient GEMM needs the gathered input, so it runs after, with the input
gradient's reduce-scatter under it; :mod:`minipar.tensor.collective_matmul` does it so): without that, the gathered input (sbh per layer) would be kept whole. So SP's bytes
per layer are TP's (4 all-reduces = 4 all-gathers + 4 reduce-scatters) **plus** those two re-gathers in
backward: with b=4, s=16, h=32, t=4 in float32, 48 KiB + 12 KiB = 60 KiB per rank; the paper's "same bytes
as TP" covers only the collectives SP replaces. ``keep_gathered=True`` (:func:`minipar.tensor.layers.
keep_gathered_inputs`) keeps the gathered input instead — t times that input's memory — and then SP's
bytes equal TP's in the log's model. On the wire one more thing shows: gloo has no reduce-scatter (it
all-reduces and keeps a chunk), so SP's four reduce-scatters move twice their ring bytes;
``with comm.ring_algorithms("reduce_scatter"):`` moves them to minipar's send/recv ring, and then SP with
the gathered inputs kept is observed to send what TP sends, up to gloo's headers.

Replicated parameters used on sequence shards (LayerNorm weights, the row-parallel biases, the position
embedding) now get only this shard's part of their gradient: :func:`sync_sequence_parallel_grads` sums
them over the group after backward.
"""
from __future__ import annotations

import torch

from .. import comm
from .operators import all_gather_dim, reduce_scatter_dim, SEQ_DIM

__all__ = ["column_linear_sequence_parallel", "sync_sequence_parallel_grads", "uncounted_bytes", "korthikanti_bytes",
           "tp_bytes_per_layer", "sp_bytes_per_layer"]


class GatheredInputLinear(torch.autograd.Function):
    """``Y = AG(X_shard) Wᵀ + b``, saving only ``X_shard`` for backward (gathered again there); with
    ``keep_gathered`` saving the gathered X instead (t times the memory, no second all-gather)."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, keep_gathered=False):
        ctx.group, ctx.has_bias, ctx.keep_gathered = group, bias is not None, keep_gathered
        x = all_gather_dim(x_shard, SEQ_DIM, group)
        ctx.save_for_backward(x if keep_gathered else x_shard, weight)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        saved, weight = ctx.saved_tensors
        x = saved if ctx.keep_gathered else all_gather_dim(saved, SEQ_DIM, ctx.group)  # again: bytes for memory
        grad_x = reduce_scatter_dim(grad_y @ weight, SEQ_DIM, ctx.group)  # each rank has a partial dX
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


def column_linear_sequence_parallel(x_shard, weight, bias, group, keep_gathered: bool = False):
    """The column-parallel matmul on a sequence shard: all-gather in; sequence-shard-only memory (the
    default: the input is all-gathered again in backward), or ``keep_gathered``: the gathered input is kept
    for backward, and the bytes equal TP's exactly (4 all-gathers + 4 reduce-scatters = 4 all-reduces)."""
    return GatheredInputLinear.apply(x_shard, weight, bias, group, keep_gathered)


def sync_sequence_parallel_grads(params, group) -> None:
    """Sum over the tensor-parallel group the gradients of replicated parameters applied to sequence
    shards (one flat all-reduce for all of them)."""
    comm.all_reduce_flat([p.grad for p in params if p.grad is not None], group=group)


# ----------------------------------------------------------------------------------------------------
# The formulas the measurements stand beside (the activation count itself: minipar.activations)
# ----------------------------------------------------------------------------------------------------

def uncounted_bytes(s, b, t=1, sequence_parallel=False, value_bytes=4, layer_norms=2) -> float:
    """What the paper's count leaves out and PyTorch keeps: each LayerNorm's mean and 1/std per token
    (2 values, on this rank's tokens) and the s × s boolean causal mask that masked_fill saves (a fused
    attention kernel keeps neither mask nor softmax)."""
    tokens = s * b / (t if sequence_parallel else 1)
    return layer_norms * 2 * tokens * value_bytes + s * s


def korthikanti_bytes(s, b, h, a, t=1, sequence_parallel=False) -> float:
    """The paper's own closed forms (16-bit, with dropout): sbh(10 + 24/t + 5as/(ht)) or sbh(34/t + 5as/(ht))."""
    if sequence_parallel:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def tp_bytes_per_layer(s, b, h, t, value_bytes=4) -> float:
    """Bytes one rank sends per layer per step under TP: 4 all-reduces of b·s·h (g forward and f backward
    for attention and for the MLP), each 2(t-1)/t · S."""
    return 4 * comm.predicted_bytes_sent("all_reduce", s * b * h * value_bytes, t)


def sp_bytes_per_layer(s, b, h, t, value_bytes=4, regather=True) -> float:
    """Under SP: each all-reduce becomes an all-gather + a reduce-scatter, the same bytes; plus, with
    ``regather`` (the default; off under ``keep_gathered``), the all-gather of each column-parallel input again
    in backward (2 per layer: QKV and fc)."""
    ag = comm.predicted_bytes_sent("all_gather", s * b * h * value_bytes, t)
    rs = comm.predicted_bytes_sent("reduce_scatter", s * b * h * value_bytes, t)
    return 4 * (ag + rs) + (2 * ag if regather else 0)

"""DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models").

Every rank holds s/N tokens of Q, K and V with all H heads. One **all-to-all** per tensor trades that for
all s tokens of H/N heads (rank r gets heads [r·H/N, (r+1)·H/N)); attention then runs on whole sequences,
head by head, with no change at all — any attention kernel, causal or not. A last all-to-all trades the
output back to sequence shards. Backward, each all-to-all's gradient is the all-to-all the other way.

**Bytes per rank per layer** (h = H · d_head, e bytes per element): each all-to-all keeps 1/N of this
rank's b(s/N)h tensor and sends the rest, ``(N−1)/N · b(s/N)h · e``; four in forward (Q, K, V in, O out):
``4 (N−1)/N · b s h e / N`` — the paper's "4Nh/P per link" — and four more in backward. Megatron's sequence
parallelism moves ``4 (N−1)/N · b s h e`` per layer forward (two all-gathers and two reduce-scatters of
bsh): Ulysses' volume falls as 1/N, Megatron's does not. The price: N must divide the number of heads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..models import causal_attention

__all__ = ["validate_heads", "seq_to_heads", "heads_to_seq", "dense_causal_attention", "ulysses_attention",
           "forward_bytes", "megatron_sp_forward_bytes"]

HEAD_DIM, SEQ_DIM = 1, 2     # tensors are (batch, heads, sequence, d_head)


def validate_heads(n_head: int, world_size: int) -> None:
    if n_head % world_size:
        raise ValueError(f"Ulysses gives each rank n_head/N whole heads, but n_head = {n_head} is not divisible "
                         f"by N = {world_size}; use N dividing the number of heads (or ring attention)")


def _all_to_all(x, scatter_dim: int, gather_dim: int, group):
    """Split ``x`` into N pieces along ``scatter_dim``, send piece j to rank j, concatenate what arrives
    along ``gather_dim`` in rank order."""
    n = dist.get_world_size(group)
    inputs = [p.contiguous() for p in x.chunk(n, dim=scatter_dim)]
    out = [torch.empty_like(inputs[0]) for _ in range(n)]
    comm.all_to_all(out, inputs, group=group)
    return torch.cat(out, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def seq_to_heads(x, group=None):
    """(b, H, s/N, d) sequence shard → (b, H/N, s, d) head shard."""
    return _AllToAll.apply(x, HEAD_DIM, SEQ_DIM, group)


def heads_to_seq(x, group=None):
    """(b, H/N, s, d) head shard → (b, H, s/N, d) sequence shard."""
    return _AllToAll.apply(x, SEQ_DIM, HEAD_DIM, group)


dense_causal_attention = causal_attention   # the single-device core, whole sequences (minipar.models)


def ulysses_attention(q, k, v, group=None, attention=dense_causal_attention):
    """Causal attention for contiguous sequence shards (b, H, s/N, d): all-to-all to heads, attend, back."""
    validate_heads(q.shape[HEAD_DIM], dist.get_world_size(group))
    q, k, v = seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group)
    return heads_to_seq(attention(q, k, v), group)


def forward_bytes(b: int, s: int, h: int, n: int, element_bytes: int = 4) -> float:
    """Four all-to-alls of b(s/N)h each: 4 (N−1)/N · b s h e / N (the backward moves as much again)."""
    return 4 * (n - 1) / n * b * s * h * element_bytes / n


def megatron_sp_forward_bytes(b: int, s: int, h: int, n: int, element_bytes: int = 4) -> float:
    """Megatron SP per layer forward: 2 all-gathers + 2 reduce-scatters of bsh: 4 (N−1)/N · b s h e."""
    return 4 * (n - 1) / n * b * s * h * element_bytes

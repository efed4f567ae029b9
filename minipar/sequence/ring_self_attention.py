"""Ring self-attention, Colossal-AI's sequence parallelism (Li et al. 2021, "Sequence Parallelism: Long
Sequence Training from System Perspective").

Rank r holds s/N tokens of Q, K and V. Two rings:

1. **Ring QKᵀ** — K travels round the ring; after N−1 passes rank r has its rows of the score matrix,
   ``S_r = Q_r [K_0 … K_{N−1}]ᵀ / √d``, (s/N) × s. The (causal) softmax is row-wise: local.
2. **Ring AV** — V travels round the ring; ``O_r = Σ_j P_r[:, j] V_j``.

Unlike ring attention, each rank materialises its (s/N) × s rows of scores: memory O(s²/N), not O(s/N).

**Backward, and the gradient scaling.** With one global loss L and dO_r = ∂L/∂O_r on rank r:
``dP_r[:, j] = dO_r V_jᵀ`` (V's ring again), ``dQ_r = dS_r K`` (K's ring again), and for the blocks a rank
does *not* own, ``dV_j = Σ_r P_r[:, j]ᵀ dO_r`` and ``dK_j = Σ_r dS_r[:, j]ᵀ Q_r``: every rank holds a partial
for every block, and a **reduce-scatter** (sum) hands rank j the total for its block. It is a sum, with no
1/N: each rank's partial is a different term of the chain rule.

The 1/N belongs to the loss, once. If each rank backpropagates the mean over *its own* tokens,
``L_r = (N/(b·s)) Σ_{t∈r} ℓ_t``, then Σ_r L_r = N · L: every gradient, through the rings or not, is N
times the single-device one, and the parameter gradients, summed over ranks, must be divided by N (an
average, as data parallelism does). Dividing the ring's dK, dV by N as well divides twice for K and V
and once for Q — the easy mistake; ``tests/test_ring_self_attention.py`` shows it fails.

**Bytes per rank per layer**: forward K and V each N−1 times, ``2(N−1) · b(s/N)h · e``; backward K and V
again N−1 times and the reduce-scatters of dK, dV ((N−1)/N of N blocks each), ``4(N−1) · b(s/N)h · e``.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from .ring_attention import _finish, _ring, _start_exchange

__all__ = ["RingQK", "RingAV", "ring_qk", "ring_av", "ring_self_attention", "forward_bytes", "backward_bytes"]


def _ring_blocks(x, group):
    """Yield (owner, block) for every rank's ``x``, starting with this rank's, passing it round the ring."""
    ranks, me = _ring(group)
    n = len(ranks)
    for step in range(n):
        if step < n - 1:
            incoming, pending = _start_exchange(x, ranks[(me + 1) % n], ranks[(me - 1) % n], group)
        yield (me - step) % n, x
        if step < n - 1:
            _finish(pending)
            x = incoming


def _reduce_to_owners(partials: list, group):
    """partials[j] = this rank's term of block j's gradient; return the sum over ranks of partials[me]."""
    return comm.ring_reduce_scatter(torch.stack(partials), group)[0] if len(partials) > 1 else partials[0]


class RingQK(torch.autograd.Function):
    """S_r = Q_r Kᵀ, the columns in global order (block j = rank j's tokens)."""

    @staticmethod
    def forward(ctx, q, k, group):
        ranks, _ = _ring(group)
        cols = [None] * len(ranks)
        for owner, k_j in _ring_blocks(k.contiguous(), group):
            cols[owner] = q @ k_j.transpose(-2, -1)
        ctx.save_for_backward(q, k)
        ctx.group = group
        return torch.cat(cols, dim=-1)

    @staticmethod
    def backward(ctx, d_s):
        q, k = ctx.saved_tensors
        n = len(_ring(ctx.group)[0])
        d_cols = d_s.chunk(n, dim=-1)
        d_q = torch.zeros_like(q)
        for owner, k_j in _ring_blocks(k.contiguous(), ctx.group):
            d_q += d_cols[owner] @ k_j
        d_k = _reduce_to_owners([d_cols[j].transpose(-2, -1) @ q for j in range(n)], ctx.group)
        return d_q, d_k, None


class RingAV(torch.autograd.Function):
    """O_r = Σ_j P_r[:, block j] V_j."""

    @staticmethod
    def forward(ctx, p, v, group):
        n = len(_ring(group)[0])
        p_cols = p.chunk(n, dim=-1)
        out = None
        for owner, v_j in _ring_blocks(v.contiguous(), group):
            term = p_cols[owner] @ v_j
            out = term if out is None else out + term
        ctx.save_for_backward(p, v)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, d_out):
        p, v = ctx.saved_tensors
        n = len(_ring(ctx.group)[0])
        d_p = [None] * n
        for owner, v_j in _ring_blocks(v.contiguous(), ctx.group):
            d_p[owner] = d_out @ v_j.transpose(-2, -1)
        p_cols = p.chunk(n, dim=-1)
        d_v = _reduce_to_owners([p_cols[j].transpose(-2, -1) @ d_out for j in range(n)], ctx.group)
        return torch.cat(d_p, dim=-1), d_v, None


def ring_qk(q, k, group=None):
    return RingQK.apply(q, k, group)


def ring_av(p, v, group=None):
    return RingAV.apply(p, v, group)


def ring_self_attention(q, k, v, group=None, causal: bool = True):
    """Attention for contiguous sequence shards (b, heads, s/N, d): ring QKᵀ, local softmax, ring AV."""
    ranks, me = _ring(group)
    chunk = q.shape[-2]
    scores = ring_qk(q, k, group) / math.sqrt(q.shape[-1])
    if causal:   # my rows are global positions me·chunk …; a column j is visible when j ≤ row
        rows = torch.arange(me * chunk, (me + 1) * chunk).unsqueeze(-1)
        scores = scores.masked_fill(torch.arange(scores.shape[-1]) > rows, float("-inf"))
    return ring_av(scores.softmax(dim=-1), v, group)


def forward_bytes(b: int, s: int, h: int, n: int, element_bytes: int = 4) -> int:
    return 2 * (n - 1) * b * (s // n) * h * element_bytes


def backward_bytes(b: int, s: int, h: int, n: int, element_bytes: int = 4) -> int:
    return 4 * (n - 1) * b * (s // n) * h * element_bytes

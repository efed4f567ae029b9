"""FlashAttention-2 in plain PyTorch: attention tiled over query and key blocks, so the s × s score matrix is
never held — only one ``block_q × block_k`` tile of it at a time (Dao 2023, "FlashAttention-2: Faster
Attention with Better Parallelism and Work Partitioning", Algorithm 1 forward, Algorithm 2 backward; the
online softmax of Milakov & Gimelshein 2018).

**Forward (Algorithm 1).** For each query block Q_i keep a running row maximum m, a running softmax
denominator ℓ and an unnormalised output Õ; for each key block K_j, V_j::

    S = Q_i K_jᵀ / √d                 m' = max(m, rowmax S)          P̃ = exp(S − m')
    ℓ' = exp(m − m') ℓ + rowsum P̃      Õ' = exp(m − m') Õ + P̃ V_j

then O_i = Õ / ℓ and the log-sum-exp L_i = m + log ℓ (shape batch × queries) — the one statistic kept for
the backward. **Causal** (query t sees keys ≤ t, top-left aligned like ``scaled_dot_product_attention``):
key blocks wholly after a query block are skipped, and only blocks the diagonal crosses are masked.

**Backward (Algorithm 2)**, by recomputation: with D = rowsum(dO ∘ O), for each key block j and query
block i, P = exp(Q_i K_jᵀ/√d − L_i) rebuilds the tile's softmax from L, then::

    dV_j += Pᵀ dO_i     dP = dO_i V_jᵀ     dS = P ∘ (dP − D_i)     dQ_i += dS K_j / √d     dK_j += dSᵀ Q_i / √d

**Memory**: besides Q, K, V the forward keeps O and L — (d + 1) numbers per token — and the backward adds
dQ, dK, dV and D; the largest temporary is one tile. O(s·d), against dense attention's O(s²)
(measured in ``tests/test_flash.py`` and chapter 06b). Ring attention runs this kernel on each key block
that arrives from its neighbour (:mod:`minipar.sequence.ring_attention`).

**Precision.** Like FlashAttention, whatever the input dtype, each tile is computed in float32 (float64 stays
float64) and m, ℓ, Õ, L, D and the dQ, dK, dV accumulators are float32; only O and the gradients are cast back
to the input dtype. Accumulating in float16 or bfloat16 instead loses the softmax at large scores (errors 200–800×
PyTorch's own float16 attention, ``tests/test_flash.py``). No keys (s_k = 0) give O = 0 and L = −∞, head size 0
an empty O, as ``scaled_dot_product_attention`` does.
"""
from __future__ import annotations

import math

import torch

__all__ = ["FlashAttention", "flash_attention", "flash_forward", "flash_backward", "key_blocks", "tiles"]


def _check(q, k, v, block_q, block_k):
    if q.dim() < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k, v must be (..., s_q, d), (..., s_k, d), (..., s_k, d) with the same leading "
                         f"dims and d; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is not None and (not isinstance(b, int) or b < 1):
            raise ValueError(f"{name} must be a positive int or None (one tile), got {b!r}")


def key_blocks(rows: range, s_k: int, block_k: int, is_causal: bool = False) -> list:
    """The key blocks (``range`` of key positions) query rows ``rows`` visit: all of them, or, causal, those
    that start at or before the block's last query (the later ones are wholly masked: skipped)."""
    last = s_k if not is_causal else min(s_k, rows.stop)        # keys ≤ the block's last query
    return [range(k0, min(k0 + block_k, s_k)) for k0 in range(0, last, block_k)]


def tiles(s_q: int, s_k: int, block_q: int, block_k: int, is_causal: bool = False) -> list:
    """[(query rows, key columns)] as ``range`` pairs for every tile the kernel computes, in the forward's
    order (query blocks outer); causal skips the tiles wholly above the diagonal."""
    return [(rows, cols) for q0 in range(0, s_q, block_q) for rows in [range(q0, min(q0 + block_q, s_q))]
            for cols in key_blocks(rows, s_k, block_k, is_causal)]


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype tiles and running statistics are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _setup(q, k, v, block_q, block_k):
    """Checked input → (s_q, s_k, block_q, block_k, scale, accumulator dtype); a ``None`` block is the whole
    dimension (at least 1, so an empty dimension gives no blocks); head size 0 has no scores to scale."""
    _check(q, k, v, block_q, block_k)
    s_q, s_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    return s_q, s_k, block_q or max(s_q, 1), block_k or max(s_k, 1), 1 / math.sqrt(max(d, 1)), _accumulator(q.dtype)


def _tile_scores(q, k, rows: range, cols: range, is_causal: bool, scale: float):
    s = (q @ k.transpose(-2, -1)) * scale
    if is_causal and cols[-1] > rows[0]:        # the diagonal crosses this tile: mask key > query
        future = (torch.arange(cols.start, cols.stop, device=q.device)
                  > torch.arange(rows.start, rows.stop, device=q.device)[:, None])
        s = s.masked_fill(future, float("-inf"))
    return s


def flash_forward(q, k, v, is_causal: bool = False, block_q: int | None = 64, block_k: int | None = 64):
    """Algorithm 1: ``(O, L)`` with O = softmax(QKᵀ/√d) V and L its log-sum-exp per query (..., s_q).
    A block size of ``None`` makes one tile of the whole dimension."""
    s_q, s_k, block_q, block_k, scale, dtype = _setup(q, k, v, block_q, block_k)
    out = torch.zeros_like(q)                   # no keys: O = 0 (and L = −∞), as PyTorch's attention gives
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
    for q0 in range(0, s_q, block_q):
        rows = range(q0, min(q0 + block_q, s_q))
        qi = q[..., q0:rows.stop, :].to(dtype)
        m = l = acc = None                      # running row max, softmax denominator, unnormalised output
        for cols in key_blocks(rows, s_k, block_k, is_causal):
            s = _tile_scores(qi, k[..., cols.start:cols.stop, :].to(dtype), rows, cols, is_causal, scale)
            vj = v[..., cols.start:cols.stop, :].to(dtype)
            m_new = s.amax(-1) if m is None else torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            if m is None:
                l, acc = p.sum(-1), p @ vj
            else:
                rescale = torch.exp(m - m_new)  # old terms were scaled by exp(−m); now by exp(−m')
                l, acc = rescale * l + p.sum(-1), rescale[..., None] * acc + p @ vj
            m = m_new
        if m is None:                           # no keys at all (s_k = 0)
            continue
        out[..., q0:rows.stop, :] = acc / l[..., None]     # cast back to the input dtype here
        lse[..., q0:rows.stop] = m + torch.log(l)
    return out, lse


def flash_backward(q, k, v, d_out, lse, delta, is_causal: bool = False,
                   block_q: int | None = 64, block_k: int | None = 64):
    """Algorithm 2: ``(dQ, dK, dV)`` from the saved L (``lse``, (..., s_q)) and D = rowsum(dO ∘ O)
    (``delta``, (..., s_q)); every tile's softmax is recomputed, none is stored."""
    s_q, s_k, block_q, block_k, scale, dtype = _setup(q, k, v, block_q, block_k)
    lse, delta = lse.to(dtype), delta.to(dtype)
    dq, dk, dv = (torch.zeros_like(x, dtype=dtype) for x in (q, k, v))   # accumulated in float32 (or 64)
    # Algorithm 2 runs key blocks in the outer loop (dK_j, dV_j stay on chip); the tiles are the forward's
    for rows, cols in sorted(tiles(s_q, s_k, block_q, block_k, is_causal), key=lambda t: t[1].start):
        r, c = slice(rows.start, rows.stop), slice(cols.start, cols.stop)
        qi, kj, vj, doi = (x[..., s, :].to(dtype) for x, s in ((q, r), (k, c), (v, c), (d_out, r)))
        p = torch.exp(_tile_scores(qi, kj, rows, cols, is_causal, scale) - lse[..., r, None])
        dv[..., c, :] += p.transpose(-2, -1) @ doi
        ds = p * (doi @ vj.transpose(-2, -1) - delta[..., r, None])
        dq[..., r, :] += (ds @ kj) * scale
        dk[..., c, :] += (ds.transpose(-2, -1) @ qi) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttention(torch.autograd.Function):
    """``FlashAttention.apply(q, k, v, is_causal=False, block_q=64, block_k=64)`` → O. Saved for the
    backward: Q, K, V, O and L (the log-sum-exp, ``ctx.saved_tensors[-1]``) — never a score tile."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, block_q=64, block_k=64):
        out, lse = flash_forward(q, k, v, is_causal, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.blocks = is_causal, (block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        dtype = _accumulator(out.dtype)
        delta = (d_out.to(dtype) * out.to(dtype)).sum(-1)       # D_i = rowsum(dO_i ∘ O_i), in float32
        dq, dk, dv = flash_backward(q, k, v, d_out, lse, delta, ctx.is_causal, *ctx.blocks)
        return dq, dk, dv, None, None, None


def flash_attention(q, k, v, is_causal: bool = False, block_q: int | None = 64, block_k: int | None = 64):
    """softmax(QKᵀ/√d [+ causal mask]) V on (..., s, d) tensors, by :class:`FlashAttention`; usable as a
    model's attention core: ``functools.partial(flash_attention, is_causal=True)``."""
    return FlashAttention.apply(q, k, v, is_causal, block_q, block_k)

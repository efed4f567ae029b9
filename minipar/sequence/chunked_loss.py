"""Cross-entropy over a large vocabulary in vocabulary chunks: the logits Z = H Wᵀ (tokens × V) are never all
held, for the forward or the backward — the online softmax of FlashAttention (:mod:`.flash`), applied to
the loss's one softmax (the idea of Liger Kernel's fused linear cross-entropy and of Wijmans et al. 2024,
"Cut Your Losses in Large-Vocabulary Language Models", here over vocabulary chunks in plain PyTorch).

For token t with hidden h_t and target y_t, ``loss_t = logsumexp_v(z_tv) − z_{t,y_t}``. **Forward**: for
each chunk W_c of c rows of W, Z_c = H W_cᵀ; the running log-sum-exp merges chunk by chunk
(``lse = logaddexp(lse, logsumexp(Z_c))``) and the target's logit is read where it falls. Only H, W, the
targets and lse (one number per token) are kept. **Backward**, Z_c recomputed: with g_t the loss's
gradient per token, ``dZ_c = g · (exp(Z_c − lse) − onehot_c(y))``, ``dH += dZ_c W_c``, ``dW_c = dZ_cᵀ H``.

Memory: the plain loss keeps the tokens × V logits (and makes their softmax and gradient, two more);
chunked, one tokens × c block exists at a time — measured in ``tests/test_chunked_loss.py``.
"""
from __future__ import annotations

import torch

__all__ = ["ChunkedCrossEntropy", "chunked_cross_entropy"]


def _targets_in(targets, lo: int, hi: int):
    """(rows whose target falls in vocabulary rows lo..hi−1, those targets' columns within the chunk)."""
    rows = ((targets >= lo) & (targets < hi)).nonzero().flatten()
    return rows, targets[rows] - lo


def _per_token_weights(targets, ignore_index: int, reduction: str, dtype):
    """The factor each token's loss enters the result with: 1 (sum) or 1/valid (mean); 0 where ignored."""
    valid = (targets != ignore_index).to(dtype)
    return valid / valid.sum().clamp(min=1) if reduction == "mean" else valid


class ChunkedCrossEntropy(torch.autograd.Function):
    """``ChunkedCrossEntropy.apply(hidden, weight, targets, chunk, reduction, ignore_index)`` =
    ``F.cross_entropy(hidden @ weight.T, targets, reduction=..., ignore_index=...)``, in vocabulary chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk=4096, reduction="mean", ignore_index=-100):
        vocab = weight.shape[0]
        lse = hidden.new_full(hidden.shape[:1], float("-inf"))
        target_logit = hidden.new_zeros(hidden.shape[:1])
        for lo in range(0, vocab, chunk):
            z = hidden @ weight[lo:lo + chunk].T                  # tokens × c: the only logits alive
            lse = torch.logaddexp(lse, z.logsumexp(-1))
            rows, cols = _targets_in(targets, lo, lo + chunk)
            target_logit[rows] = z[rows, cols]
        w = _per_token_weights(targets, ignore_index, reduction, hidden.dtype)
        ctx.save_for_backward(hidden, weight, targets, lse, w)
        ctx.chunk = chunk
        return (w * (lse - target_logit)).sum()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse, w = ctx.saved_tensors
        g = grad * w                                              # dloss / dloss_t
        d_hidden, d_weight = torch.zeros_like(hidden), torch.empty_like(weight)
        for lo in range(0, weight.shape[0], ctx.chunk):
            wc = weight[lo:lo + ctx.chunk]
            dz = torch.exp(hidden @ wc.T - lse[:, None])          # softmax of this chunk, recomputed
            rows, cols = _targets_in(targets, lo, lo + ctx.chunk)
            dz[rows, cols] -= 1
            dz *= g[:, None]
            d_hidden += dz @ wc
            d_weight[lo:lo + ctx.chunk] = dz.T @ hidden
        return d_hidden, d_weight, None, None, None, None


def chunked_cross_entropy(hidden, weight, targets, chunk: int = 4096, reduction: str = "mean",
                          ignore_index: int = -100):
    """Cross-entropy of the logits ``hidden @ weight.T`` ((tokens, d) @ (d, V)) against ``targets``
    (tokens,), computed ``chunk`` vocabulary rows at a time (see the module docstring)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be (tokens, d) and weight (vocab, d); got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1] or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integer class indices of shape ({hidden.shape[0]},); "
                         f"got {targets.dtype} {tuple(targets.shape)}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
    if bad.any():
        raise ValueError(f"target {int(targets[bad][0])} is outside the vocabulary 0 … {weight.shape[0] - 1}")
    return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk, reduction, ignore_index)

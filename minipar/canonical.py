"""The canonical reductions of the invariant mode (:mod:`minipar.invariant_mode`): one order of addition for every
dimension a layout may split, on one device and across ranks alike.

The order is :func:`tree_sum`: a dimension of n = 2^k elements is summed as a balanced tree of adjacent pairs,
``(x0 + x1) + (x2 + x3)``, ... A contiguous, aligned chunk of 2^j elements — what a rank holds of a dimension
a power-of-two layout splits — is a subtree, so the rank's partial sum is that subtree's value, and
:func:`minipar.comm.all_reduce` in the mode (all-gather, then the same tree over the ranks in rank order) completes exactly the tree
one device builds. Elementwise multiplication and addition are correctly rounded, so a product formed
elementwise and summed by the tree has the same bits whatever the shapes around it: no BLAS kernel is trusted
to keep a per-element order across output shapes.

* :class:`Matmul` — ``a @ b`` with the inner dimension summed by the tree; backward likewise
  (``da = g bᵀ`` over b's columns, ``db = aᵀ g`` over a's rows: the tokens, for a weight gradient).
* :func:`linear`, :class:`AddBias`, :class:`LayerNorm`, :class:`Embedding` — their parameter gradients are
  sums over tokens (:func:`token_sum`: rows × positions flattened, one tree); under sequence parallelism a rank
  holds a chunk of each row's positions, so it sums per row, all-gathers the rows' partials over the group,
  and finishes the tree (rows × ranks, flattened).
* :class:`Softmax` (Σ exp over keys), :func:`mean` (the loss over tokens), :func:`causal_attention`.
* Context parallelism (the mode entered with a cp group, :func:`minipar.invariant_mode.cp_group`): rank r
  holds chunk r of every row's positions, so every sum over tokens (the weight gradients, the loss) is
  finished row by row over the cp group (:func:`token_sum`), and :func:`context_parallel_attention` gathers
  K and V in key order so that each query row sums over the same s keys in the same tree as one device.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import comm
from .invariant_mode import cp_group
from .tree import tree_sum

__all__ = ["tree_sum", "token_sum", "Matmul", "matmul", "Linear", "linear",
           "AddBias", "LayerNorm", "Softmax", "Embedding", "mean", "causal_attention", "GatherSequence",
           "context_parallel_attention"]


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _gathered(t: torch.Tensor, group) -> torch.Tensor:
    """(ranks, *t.shape): every rank's ``t`` in rank order (one all-gather through minipar.comm: logged)."""
    n = _group_size(group)
    out = t.new_empty((n * t.numel(),))
    comm.all_gather_into_tensor(out, t.contiguous().reshape(-1), group=group)
    return out.view((n,) + tuple(t.shape))


def token_sum(per_token: torch.Tensor, seq_group=None) -> torch.Tensor:
    """Σ over the tokens of ``per_token`` (rows, positions, *P) in the canonical order (rows × positions
    flattened, one tree: each row's positions a subtree). ``seq_group``: the group whose ranks hold chunks of
    this chunk of positions (sequence parallelism); the mode's :func:`cp_group` holds chunks of the rows'
    positions around it (context parallelism). For each, innermost first: per-row partials, all-gathered,
    finished over the ranks in rank order (a power-of-two chunk's tree is a subtree of its row's); then the
    tree over the rows — the same value on every rank."""
    groups = [g for g in (seq_group, cp_group()) if g is not None and _group_size(g) > 1]
    if not groups:
        return tree_sum(per_token.flatten(0, 1))
    per_row = tree_sum(per_token, 1)                                   # (rows, *P): subtrees of the rows' trees
    for group in groups:
        per_row = tree_sum(_gathered(per_row, group))                  # (ranks, rows, *P) → the rows' larger chunks
    return tree_sum(per_row)


class Matmul(torch.autograd.Function):
    """``a @ b`` (a: (..., M, K), b: (..., K, N)) with every inner sum a :func:`tree_sum`, forward and backward."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return tree_sum(a.unsqueeze(-1) * b.unsqueeze(-3), -2)                    # Σ_k a_mk b_kn

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        da = tree_sum(g.unsqueeze(-2) * b.unsqueeze(-3), -1)                      # Σ_n g_mn b_kn
        db = tree_sum(a.unsqueeze(-1) * g.unsqueeze(-2), -3)                      # Σ_m a_mk g_mn
        return da, db


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return Matmul.apply(a, b)


class AddBias(torch.autograd.Function):
    """``y + bias`` over (rows, positions, features); the bias gradient is :func:`token_sum` of dY."""

    @staticmethod
    def forward(ctx, y, bias, seq_group):
        ctx.seq_group = seq_group
        return y + bias

    @staticmethod
    def backward(ctx, g):
        return g, token_sum(g, ctx.seq_group), None


class Linear(torch.autograd.Function):
    """``x Wᵀ`` on (rows, positions, in) with every sum a tree: the inner sum forward, Σ over the output
    features for dX, and dW = :func:`token_sum` of the tokens' outer products dy_t x_tᵀ (over the rows' chunks
    held by other ranks too)."""

    @staticmethod
    def forward(ctx, x, weight, seq_group):
        ctx.save_for_backward(x, weight)
        ctx.seq_group = seq_group
        return tree_sum(x.unsqueeze(-2) * weight, -1)                             # Σ_i x_ti W_oi

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        dx = tree_sum(g.unsqueeze(-1) * weight, -2)                               # Σ_o g_to W_oi
        return dx, token_sum(g.unsqueeze(-1) * x.unsqueeze(-2), ctx.seq_group), None   # Σ_t g_to x_ti


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, seq_group=None):
    """``x Wᵀ + b`` on (rows, positions, in): the inner sum and the weight and bias gradients' sums over
    tokens are trees. ``seq_group``: the group holding chunks of ``x``'s positions (sequence shards)."""
    y = Linear.apply(x, weight, seq_group)
    return y if bias is None else AddBias.apply(y, bias, seq_group)


class LayerNorm(torch.autograd.Function):
    """LayerNorm over the last dimension with tree sums for the statistics and for the weight and bias
    gradients (sums over tokens; ``seq_group`` as :func:`token_sum`). sqrt and division are correctly
    rounded; no rsqrt."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, seq_group):
        h = x.shape[-1]
        centred = x - (tree_sum(x, -1) / h).unsqueeze(-1)
        rstd = 1.0 / torch.sqrt(tree_sum(centred * centred, -1) / h + eps)
        xhat = centred * rstd.unsqueeze(-1)
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.seq_group = seq_group
        return xhat * weight + bias

    @staticmethod
    def backward(ctx, g):
        xhat, rstd, weight = ctx.saved_tensors
        h = xhat.shape[-1]
        gxhat = g * weight
        mean_g = (tree_sum(gxhat, -1) / h).unsqueeze(-1)
        mean_gx = (tree_sum(gxhat * xhat, -1) / h).unsqueeze(-1)
        dx = (gxhat - mean_g - xhat * mean_gx) * rstd.unsqueeze(-1)
        return dx, token_sum(g * xhat, ctx.seq_group), token_sum(g, ctx.seq_group), None, None


def layer_norm(module, x, seq_group=None):
    """An ``nn.LayerNorm`` ``module`` applied canonically to ``x``."""
    return LayerNorm.apply(x, module.weight, module.bias, module.eps, seq_group)


class Softmax(torch.autograd.Function):
    """softmax over the last dimension: the max is exact in any order, Σ exp is a tree."""

    @staticmethod
    def forward(ctx, x):
        e = (x - x.max(-1, keepdim=True).values).exp()
        y = e / tree_sum(e, -1).unsqueeze(-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return y * (g - tree_sum(g * y, -1).unsqueeze(-1))


class Embedding(torch.autograd.Function):
    """``weight[idx]`` on (rows, positions) ids; the gradient of row v is :func:`token_sum` of dY over the
    tokens whose id is v (a one-hot product: the others add exact zeros), not a scatter-add in token order."""

    @staticmethod
    def forward(ctx, idx, weight, seq_group):
        ctx.save_for_backward(idx)
        ctx.rows, ctx.seq_group = weight.shape[0], seq_group
        return weight[idx]

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        one_hot = torch.nn.functional.one_hot(idx, ctx.rows).to(g.dtype)          # (rows, positions, V)
        return None, token_sum(one_hot.unsqueeze(-1) * g.unsqueeze(-2), ctx.seq_group), None


def embedding(idx, weight, seq_group=None):
    return Embedding.apply(idx, weight, seq_group)


class TokenTotal(torch.autograd.Function):
    """:func:`token_sum` of per-token values (rows, positions): the whole total on every cp rank (each
    computes the same loss); its gradient to each of this rank's tokens is the total's (the others' tokens are
    the other ranks')."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return token_sum(x)

    @staticmethod
    def backward(ctx, g):
        return g.expand(ctx.shape)


def mean(x: torch.Tensor) -> torch.Tensor:
    """The mean over the tokens (rows, positions) — the loss: a tree over them all (the cp ranks' chunks of
    each row too), then ÷ their count."""
    return TokenTotal.apply(x) / (x.numel() * _group_size(cp_group()))


def causal_attention(q, k, v, dropout=None, first_query: int = 0):
    """:func:`minipar.models.causal_attention` with its three reductions canonical: QKᵀ over d_head, Σ exp over
    the keys, and the probabilities times V over the keys (forward and backward). ``first_query``: the
    position of q's first row among k's (context parallelism: this rank's chunk of the queries)."""
    att = matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    queries = torch.arange(first_query, first_query + q.shape[-2], device=q.device)
    mask = torch.arange(k.shape[-2], device=q.device) <= queries.unsqueeze(-1)   # key j ≤ query i
    att = Softmax.apply(att.masked_fill(~mask, float("-inf")))
    return matmul(att if dropout is None else dropout(att), v)


class GatherSequence(torch.autograd.Function):
    """(…, s/n, d) chunks of the n ranks of ``group`` → (…, s, d) in sequence order (rank r holds chunk r, the
    ring's contiguous layout). Backward: this rank's gradient for the whole sequence is a partial sum over its
    own queries — a subtree, its chunk of the query tree — so each chunk goes to its owner (all-to-all) and the
    owner finishes the tree over the ranks in rank order: a reduce-scatter as a tree."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return torch.cat(_gathered(x, group).unbind(0), -2)                       # all-gather, in rank order

    @staticmethod
    def backward(ctx, g):
        n = _group_size(ctx.group)
        mine = torch.stack(g.chunk(n, -2)).contiguous()                           # (n, …, s/n, d): chunk j → rank j
        theirs = torch.empty_like(mine)
        comm.all_to_all_single(theirs, mine, [1] * n, [1] * n, group=ctx.group)   # rank j's partial of my chunk
        return tree_sum(theirs), None


def context_parallel_attention(q, k, v, group):
    """Causal attention of this rank's queries — chunk r of the sequence on rank r of the cp ``group`` — over
    the whole sequence, canonical: K and V all-gathered in key order (:class:`GatherSequence`), then
    :func:`causal_attention`, whose trees over the s keys are one device's for every query row (the output and
    dQ: bit for bit); dK and dV, sums over the queries, are finished across the ranks in the gather's
    backward. Bytes per rank: the all-gather and the all-to-all, (n−1)/n · |K, V| each."""
    kv = GatherSequence.apply(torch.stack([k, v]), group)
    return causal_attention(q, kv[0], kv[1], first_query=dist.get_rank(group) * q.shape[-2])

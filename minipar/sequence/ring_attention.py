"""Causal ring attention: each rank keeps s/N tokens of Q, K, V; the K,V blocks travel round the ring and
every rank merges the partial attentions with the log-sum-exp rule (Liu, Zaharia & Abbeel 2023, "Ring
Attention with Blockwise Transformers"; the online softmax of Milakov & Gimelshein 2018 and FlashAttention).

**The merge.** Attention of a query row over a key block B is ``o_B = Σ_{j∈B} exp(s_j − lse_B) v_j`` with
``lse_B = log Σ_{j∈B} exp(s_j)``. Two blocks A, B of the same row merge exactly::

    lse = log(exp(lse_A) + exp(lse_B))            (torch.logaddexp: never exponentiates a large number)
    o   = exp(lse_A − lse) · o_A + exp(lse_B − lse) · o_B

so no rank ever holds a whole row of scores: memory per rank is O(s/N · h) plus one (s/N)² block.
**Each block is one call of the single-device kernel**, FlashAttention-2 (:mod:`minipar.sequence.flash`,
Dao 2023, Algorithms 1 and 2), whose key tiles here arrive from the ring: its forward gives the block's
(o_B, lse_B), its backward the block's dQ, dK, dV from the merged lse.

**Causal and load balance.** Cut the sequence into chunks; a query chunk attends to key chunks with a
lower index fully, to its own chunk with the triangular mask, and skips later ones. With N contiguous
chunks rank r computes r + 1 blocks: rank N−1 does N times the work of rank 0. **Zig-zag** cuts 2N chunks
and gives rank r chunks r and 2N−1−r: every rank then computes 2N + 1 (half-size) chunk pairs (the layout of
zhuzilin/ring-flash-attention's ``zigzag_ring_flash_attn``, 2024, its issue #2; Llama 3's context
parallelism, Dubey et al. 2024 §3.3.2, uses the same one).

**Bytes per rank per layer** (b batch, s sequence, h = heads · d_head, e bytes per element):
forward, K and V passed N−1 times: ``2(N−1) · b(s/N)h · e``; backward, K,V passed again N−1 times and their
gradient accumulators dK, dV N times (the last pass hands each accumulator home): ``(4N−2) · b(s/N)h · e``.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import canonical, comm
from ..invariant_mode import active as invariant_active
from .flash import flash_backward, flash_forward

__all__ = ["chunk_ids", "positions", "validate_sequence", "shard_sequence", "unshard_sequence",
           "block_attention", "lse_merge", "causal_pairs", "RingAttention", "ring_attention", "forward_bytes", "backward_bytes"]


# ----------------------------------------------------------------------------------------------------
# Which tokens a rank holds
# ----------------------------------------------------------------------------------------------------

def chunk_ids(rank: int, world_size: int, zigzag: bool = False) -> list:
    """The sequence chunks rank ``rank`` holds: ``[rank]`` of N, or zig-zag ``[rank, 2N−1−rank]`` of 2N."""
    return [rank, 2 * world_size - 1 - rank] if zigzag else [rank]


def validate_sequence(seq_len: int, world_size: int, zigzag: bool = False) -> None:
    """ValueError unless ``seq_len`` splits into N (or, zig-zag, 2N) equal chunks."""
    parts = 2 * world_size if zigzag else world_size
    if seq_len % parts:
        how = f"2N = {parts} chunks (zig-zag: rank r holds chunks r and 2N−1−r)" if zigzag else f"N = {parts} chunks"
        raise ValueError(f"sequence length {seq_len} does not split into {how}; "
                         f"use a sequence length divisible by {parts}")


def positions(seq_len: int, rank: int, world_size: int, zigzag: bool = False) -> torch.Tensor:
    """The global token positions rank ``rank`` holds, in the order it holds them."""
    validate_sequence(seq_len, world_size, zigzag)
    c = seq_len // (2 * world_size if zigzag else world_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, world_size, zigzag)])


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, zigzag: bool = False, dim: int = -2):
    """Rank ``rank``'s tokens of ``x`` along ``dim``."""
    return x.index_select(dim, positions(x.shape[dim], rank, world_size, zigzag)).contiguous()


def unshard_sequence(shards: list, zigzag: bool = False, dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's shard (the inverse of :func:`shard_sequence`)."""
    n = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    order = torch.cat([positions(seq_len, r, n, zigzag) for r in range(n)])
    return torch.cat(shards, dim).index_select(dim, torch.argsort(order))


# ----------------------------------------------------------------------------------------------------
# One block, and the merge
# ----------------------------------------------------------------------------------------------------

def _scores(q, k, diagonal: bool):
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if diagonal:   # query chunk = key chunk: the causal triangle
        t = s.shape[-1]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return s


def block_attention(q, k, v, diagonal: bool = False):
    """Attention of ``q`` over one key block: ``(o_B, lse_B)``, o normalised within the block."""
    s = _scores(q, k, diagonal)
    lse = s.logsumexp(-1, keepdim=True)
    return torch.exp(s - lse) @ v, lse


def lse_merge(o_a, lse_a, o_b, lse_b):
    """Merge two partial attentions of the same query rows (see the module docstring)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse) * o_a + torch.exp(lse_b - lse) * o_b, lse


def causal_pairs(my_chunks, their_chunks):
    """(i, j, diagonal) for every query chunk i of mine and key chunk j of theirs that is not masked out."""
    return [(i, j, cq == ck) for i, cq in enumerate(my_chunks) for j, ck in enumerate(their_chunks) if ck <= cq]


# ----------------------------------------------------------------------------------------------------
# The ring
# ----------------------------------------------------------------------------------------------------

def _ring(group):
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = ranks.index(dist.get_rank())
    return ranks, me


def _start_exchange(buf, right, left, group):
    """Post: send ``buf`` to the right neighbour, receive the left one's into a new buffer."""
    incoming = torch.empty_like(buf)
    return incoming, (buf, [comm.isend(buf, right, group), comm.irecv(incoming, left, group)])


def _finish(pending):
    _, requests = pending            # the send buffer stays referenced until its send is done
    for r in requests:
        r.wait()


class RingAttention(torch.autograd.Function):
    """The ring: forward merges the K,V blocks as they pass; backward passes them again with their dK, dV."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag):
        ranks, me = _ring(group)
        n = len(ranks)
        right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
        mine = chunk_ids(me, n, zigzag)
        qs = q.chunk(len(mine), dim=-2)
        acc = [None] * len(mine)                         # per query chunk: (o, lse) merged so far
        kv = torch.stack([k, v]).contiguous()
        for step in range(n):
            src = (me - step) % n                        # whose K,V block I hold now
            if step < n - 1:                             # next block in flight while I compute
                incoming, pending = _start_exchange(kv, right, left, group)
            ks, vs = kv[0].chunk(len(mine), dim=-2), kv[1].chunk(len(mine), dim=-2)
            for i, j, diagonal in causal_pairs(mine, chunk_ids(src, n, zigzag)):
                o, lse = flash_forward(qs[i], ks[j], vs[j], diagonal, block_q=None, block_k=None)
                acc[i] = (o, lse[..., None]) if acc[i] is None else lse_merge(*acc[i], o, lse[..., None])
            if step < n - 1:
                _finish(pending)
                kv = incoming
        out = torch.cat([o for o, _ in acc], dim=-2)
        lse = torch.cat([lse for _, lse in acc], dim=-2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.zigzag = group, zigzag
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        ranks, me = _ring(ctx.group)
        n, group = len(ranks), ctx.group
        right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
        mine = chunk_ids(me, n, ctx.zigzag)
        parts = len(mine)
        qs, dos = q.chunk(parts, -2), d_out.chunk(parts, -2)
        lses = lse.squeeze(-1).chunk(parts, -1)
        deltas = (d_out * out).sum(-1).chunk(parts, -1)                  # D_i = rowsum(dO ∘ O)
        dq = [torch.zeros_like(x) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv)                       # the accumulator that travels with its block
        for step in range(n):
            src = (me - step) % n
            if step < n - 1:
                incoming, pending = _start_exchange(kv, right, left, group)
            ks, vs = kv[0].chunk(parts, -2), kv[1].chunk(parts, -2)
            dks, dvs = list(dkv[0].chunk(parts, -2)), list(dkv[1].chunk(parts, -2))
            for i, j, diagonal in causal_pairs(mine, chunk_ids(src, n, ctx.zigzag)):
                # FlashAttention-2's backward on this block: its softmax rebuilt from the merged lse
                dqi, dkj, dvj = flash_backward(qs[i], ks[j], vs[j], dos[i], lses[i], deltas[i], diagonal,
                                               block_q=None, block_k=None)
                dq[i], dks[j], dvs[j] = dq[i] + dqi, dks[j] + dkj, dvs[j] + dvj
            dkv = torch.stack([torch.cat(dks, -2), torch.cat(dvs, -2)]).contiguous()
            if step < n - 1:
                _finish(pending)
                kv = incoming
            if n > 1:   # hand the accumulator on with its block; after the last step it comes home
                dkv, pending = _start_exchange(dkv, right, left, group)
                _finish(pending)
        return torch.cat(dq, -2), dkv[0], dkv[1], None, None


def ring_attention(q, k, v, group=None, zigzag: bool = False):
    """Causal attention of this rank's queries over the whole sequence, for (b, heads, s/N, d) shards laid
    out by :func:`shard_sequence` (contiguous, or zig-zag). Its work and time are measured beside it
    (:mod:`minipar.sequence.measure`). In the invariant mode (contiguous chunks only) no ring: K and V
    all-gathered in key order, attended in one device's trees (:func:`minipar.canonical.context_parallel_attention`)."""
    if invariant_active():
        if zigzag:
            raise ValueError("the invariant mode's context-parallel attention needs contiguous chunks (not zig-zag)")
        return canonical.context_parallel_attention(q, k, v, group)
    return RingAttention.apply(q, k, v, group, zigzag)


def forward_bytes(b: int, s: int, h: int, n: int, element_bytes: int = 4) -> int:
    """Bytes one rank sends in the forward: K and V, N−1 times each: 2(N−1) · b(s/N)h · e."""
    return 2 * (n - 1) * b * (s // n) * h * element_bytes


def backward_bytes(b: int, s: int, h: int, n: int, element_bytes: int = 4) -> int:
    """Backward: K,V again N−1 times plus dK,dV N times: (4N−2) · b(s/N)h · e."""
    return (4 * n - 2) * b * (s // n) * h * element_bytes

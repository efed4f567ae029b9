"""Checks for chapter 06b's exercises: the log-sum-exp merge of two partial attentions, the zig-zag
assignment of sequence chunks to ranks, and the online-softmax forward over key blocks (FlashAttention-2's
Algorithm 1, :mod:`minipar.sequence.flash`).

Each compares the learner's answer with the library's (:mod:`minipar.sequence.ring_attention`), tries the
cases where a plausible wrong answer breaks (scores large enough to overflow ``exp`` in float32; a rank
count where a near-miss assignment leaves a chunk out or unbalances the work), and names the likely mistake.
"""
from __future__ import annotations

import torch

from torch.overrides import TorchFunctionMode

from minipar.course.checks import fail
from minipar.sequence import ring_attention as ra

__all__ = ["check_lse_merge", "check_zigzag", "causal_work", "check_online_softmax"]


def _attention_problem(scale=1.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g, dtype=dtype) for _ in range(3))
    return q * scale, k * scale, v


def _merged(merge, q, k, v, split):
    a = ra.block_attention(q, k[..., :split, :], v[..., :split, :])
    b = ra.block_attention(q, k[..., split:, :], v[..., split:, :])
    out = merge(*a, *b)
    if not (isinstance(out, tuple) and len(out) == 2):
        fail("merge(o_a, lse_a, o_b, lse_b)", "a pair (o, lse)", type(out).__name__,
             "return both the merged output and the merged log-sum-exp: the next merge needs lse")
    return out


def check_lse_merge(merge) -> None:
    """``merge(o_a, lse_a, o_b, lse_b) -> (o, lse)`` must equal attention over both key blocks at once."""
    q, k, v = _attention_problem()
    want_o, want_lse = ra.block_attention(q, k, v)
    for split in (2, 5):
        o, lse = _merged(merge, q, k, v, split)
        if not torch.allclose(lse, want_lse, atol=1e-10):
            bigger = torch.maximum(*(ra.block_attention(q, k[..., s, :], v[..., s, :])[1]
                                     for s in (slice(None, split), slice(split, None))))
            mistake = ("this is max(lse_a, lse_b): the denominators add, lse = log(exp(lse_a) + exp(lse_b)) "
                       "(torch.logaddexp)" if torch.allclose(lse, bigger) else
                       "lse = torch.logaddexp(lse_a, lse_b): the two blocks' softmax denominators add")
            fail(f"merged lse, keys split {split} | {6 - split}", "log Σ_j exp(s_j) over all keys",
                 f"max |Δ| = {float((lse - want_lse).abs().max()):.3g}", mistake)
        if not torch.allclose(o, want_o, atol=1e-10):
            halves = (ra.block_attention(q, k[..., :split, :], v[..., :split, :])[0] +
                      ra.block_attention(q, k[..., split:, :], v[..., split:, :])[0]) / 2
            mistake = ("this is the plain average of o_a and o_b: each block must weigh by its share of the "
                       "softmax mass, exp(lse_a − lse) and exp(lse_b − lse)" if torch.allclose(o, halves) else
                       "o = exp(lse_a − lse) · o_a + exp(lse_b − lse) · o_b, with lse the merged one")
            fail(f"merged output, keys split {split} | {6 - split}", "attention over all keys at once",
                 f"max |Δ| = {float((o - want_o).abs().max()):.3g}", mistake)
    q, k, v = _attention_problem(scale=12.0, dtype=torch.float32)   # scores ~ ±300: exp(300) overflows float32
    o, lse = _merged(merge, q, k, v, 3)
    want_o, _ = ra.block_attention(q.double(), k.double(), v.double())
    if not torch.isfinite(o).all() or not torch.allclose(o.double(), want_o, atol=1e-4):
        fail("merge with large scores (float32, |s| up to ~300)", "finite, equal to one-block attention",
             "inf/nan" if not torch.isfinite(o).all() else f"max |Δ| = {float((o.double() - want_o).abs().max()):.3g}",
             "exp(lse_a) overflows float32 past ~88: never exponentiate an lse alone; use exp(lse_a − lse) "
             "with lse = torch.logaddexp(lse_a, lse_b)")
    print("lse merge: equals attention over both blocks, and stays finite where exp(lse) would overflow")


def causal_work(assign, world_size: int) -> list:
    """Causal chunk pairs (query chunk ≥ key chunk) each rank computes when rank r holds ``assign(r, N)``."""
    return [sum(q + 1 for q in assign(r, world_size)) for r in range(world_size)]


def check_zigzag(assign) -> None:
    """``assign(rank, world_size)`` -> the two chunks (of 2N) rank holds: every chunk once, equal causal work."""
    for n in (2, 4, 8):
        got = [list(assign(r, n)) for r in range(n)]
        want = [ra.chunk_ids(r, n, zigzag=True) for r in range(n)]
        flat = sorted(c for chunks in got for c in chunks)
        if flat != list(range(2 * n)):
            fail(f"zig-zag on N = {n} ranks: the chunks held", f"each of 0 … {2 * n - 1} exactly once",
                 got, "with 2N chunks, rank r takes chunk r from the front and chunk 2N−1−r from the back "
                      "(2N−r is one past the end for r = 0)")
        work = causal_work(assign, n)
        if len(set(work)) != 1:
            fail(f"zig-zag on N = {n} ranks: causal chunk pairs per rank", f"equal on every rank ({2 * n + 1})",
                 work, "pair an early chunk (little work: few keys before it) with a late one (much work): "
                       "r with 2N−1−r; [2r, 2r+1] is just the contiguous split, [r, N+r] still grows with r")
        if [sorted(g) for g in got] != want:
            fail(f"zig-zag on N = {n} ranks: which rank holds what", want, got,
                 "rank r holds chunks r and 2N−1−r (the layout the ring's causal skipping assumes)")
    print("zig-zag: every chunk held once, 2N+1 causal chunk pairs on every rank, for N = 2, 4, 8")


class _WidestProduct(TorchFunctionMode):
    """The widest last dimension of any matrix product run while active (a score block is q × keys)."""

    def __init__(self):
        super().__init__()
        self.widest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("matmul", "__matmul__", "bmm", "einsum") and isinstance(out, torch.Tensor):
            self.widest = max(self.widest, out.shape[-1])
        return out


def _online(attend, q, k, v, block):
    with _WidestProduct() as product:
        out = attend(q, k, v, block)
    if not (isinstance(out, tuple) and len(out) == 2):
        fail("online_softmax_attention(q, k, v, block)", "a pair (o, lse)", type(out).__name__,
             "return the normalised output and L = m + log ℓ: the backward (and the ring's merge) needs L")
    if product.widest > max(block, q.shape[-1]):
        fail(f"the widest matrix product with block = {block}", f"at most {block} key columns",
             f"{product.widest} columns", "the point is never to hold a row of scores over all keys: compute "
                                          "S = Q K_jᵀ for one block K_j = k[..., j:j+block, :] at a time")
    return out


def check_online_softmax(attend) -> None:
    """``attend(q, k, v, block) -> (o, lse)``: attention over the keys taken ``block`` at a time with a
    running max, sum and output, equal to one-block attention (o, and lse of shape (..., queries))."""
    q, k, v = _attention_problem()                                  # 6 keys
    want_o, want_lse = ra.block_attention(q, k, v)
    want_lse = want_lse[..., 0]
    for block in (6, 4, 1):                                         # one block first: the plain softmax
        o, lse = _online(attend, q, k, v, block)
        if o.shape != want_o.shape or not torch.allclose(o, want_o, atol=1e-10):
            mistake = ("o = softmax(Q Kᵀ / √d) V: the scores are scaled by 1/√d, and the output is divided by the "
                       "softmax sum ℓ once, at the end" if block == 6 else
                       "with several key blocks: when the running max grows from m to m', the sum ℓ and the output "
                       "accumulated so far must be multiplied by exp(m − m') before this block's exp(S − m') and "
                       "exp(S − m')·V_j are added (unnormalised; divide by ℓ once, after the last block)")
            fail(f"output with block = {block} (6 keys)", "attention over all keys at once",
                 f"shape {tuple(o.shape)}" if o.shape != want_o.shape else
                 f"max |Δ| = {float((o - want_o).abs().max()):.3g}", mistake)
        if lse.shape != want_lse.shape or not torch.allclose(lse, want_lse, atol=1e-10):
            mistake = (f"lse has one number per query, shape {tuple(want_lse.shape)} (no trailing 1)"
                       if lse.shape != want_lse.shape else
                       "L = m + log ℓ: ℓ is the sum of exp(s − m), so the running max must be added back")
            fail(f"lse with block = {block}", "log Σ_j exp(s_j) over all keys",
                 f"shape {tuple(lse.shape)}" if lse.shape != want_lse.shape else
                 f"max |Δ| = {float((lse - want_lse).abs().max()):.3g}", mistake)
    q, k, v = _attention_problem(scale=12.0, dtype=torch.float32)   # scores ~ ±300: exp(300) overflows
    o, lse = _online(attend, q, k, v, 4)
    want_o, _ = ra.block_attention(q.double(), k.double(), v.double())
    if not torch.isfinite(o).all() or not torch.allclose(o.double(), want_o, atol=1e-4):
        fail("large scores (float32, |s| up to ~300), block = 4", "finite, equal to one-block attention",
             "inf/nan" if not torch.isfinite(o).all() else f"max |Δ| = {float((o.double() - want_o).abs().max()):.3g}",
             "exp(s) overflows float32 past ~88: exponentiate s − m with m the running row max, never s itself")
    print("online softmax: equals attention over all keys for blocks of 6, 4 and 1 keys, finite for scores "
          "near 300 in float32, never a product wider than one block")

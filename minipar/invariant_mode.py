"""The invariant mode: every layout trains one device's parameters bitwise (float32), not within a tolerance.

Float addition is not associative: ``(a + b) + c`` and ``a + (b + c)`` may differ in the last bit, and every
dimension a layout splits changes an order of addition — tokens across DP ranks and micro-batches (weight
gradients, the loss mean), the inner dimension across TP ranks (row-parallel forward, column-parallel
backward), the vocabulary across TP ranks (the softmax's Σ exp), a ring's order in an all-reduce. Inside
``with invariant():`` every such reduction is done in one canonical order (:mod:`minipar.canonical`): the
dimension is cut into single elements and summed in a fixed balanced tree of adjacent pairs, on one device and
across ranks alike. A rank's local partial is then a subtree (its contiguous, power-of-two aligned chunk) and
the cross-rank combination (an all-gather, then the same tree over the ranks in rank order) completes the
same tree one device builds. Elementwise operations are deterministic, and scaling by a power of two
(1/dp, 1/m, a mean over 2^k tokens) is exact, so the losses and every parameter after AdamW steps are
``torch.equal`` to one device's in the same mode (tests/test_invariant.py: dp 2 and 4, m 2 and 4, tp 2 and 4
with SP and the vocabulary-parallel loss, dp 2 × tp 2, dp 2 × pp 2 × tp 2; 3 steps). PP stages only move work:
nothing to change. Not covered yet, and refused before launch (:func:`validate`): cp, ZeRO, MoE, dropout.

The reference is the same program on one device in the same mode (the default mode's numbers are another
order's: equal to the invariant mode's only within a tolerance).

Cost, measured (gpt_recipe: 2 layers, hidden 32, vocab 64, batch 8 × seq 16, float32, AdamW; gloo, one CPU
thread per rank; median step over steps 2-6 and the ranks, on a shared 2-core machine, so ±30 %):

    layout                  step, default → invariant     bytes per rank per step (model), default → invariant
    one device, m 1         12 ms → 47 ms (3.8×)          —
    dp 2 × tp 2, m 2        54 ms → 135 ms (2.5×)         dp 64 KB → 64 KB (1×), tp 83 KB → 115 KB (1.4×)
    dp 4                    92 ms → 62 ms (noise)         dp 184 KB → 367 KB (2×)
    tp 4 + SP               184 ms → 175 ms (noise)       tp 318 KB → 1005 KB (3.2×)

Time: every product is formed elementwise and summed by the tree (no BLAS). Bytes: an all-reduce becomes an
all-gather, (n−1)·S sent per rank instead of a ring's 2(n−1)/n·S (n/2 times: equal at n = 2), and a fused QKV
layer's f runs once per part. Production systems pay less: batch-invariant kernels fix the tile order inside
the GEMM instead of forgoing it, and a fixed-order (tree) all-reduce keeps a reduce-scatter's bytes.

``minipar.invariant()`` is a context manager (a ``ContextVar``, like :func:`minipar.hooks.installed`: scoped
to this thread's block, no global, no environment variable); :func:`active` says whether it is on. Ranks are
separate processes: a trainer takes ``invariant=True`` as an argument and enters the mode itself in each
rank (:class:`minipar.hybrid.parallel3d.Trainer3D`), so nothing is inherited by accident.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

__all__ = ["invariant", "active", "in_own_mode", "validate", "MicroBatchGradients"]

_on: contextvars.ContextVar = contextvars.ContextVar("minipar_invariant", default=False)


@contextlib.contextmanager
def invariant(on: bool = True):
    """Inside the block (``on=True``) every split reduction runs in the canonical order; ``on=False``: the
    default mode inside the block, whatever is outside."""
    token = _on.set(bool(on))
    try:
        yield
    finally:
        _on.reset(token)


def active() -> bool:
    """Whether the invariant mode is on here."""
    return _on.get()


def in_own_mode(method):
    """A method of an object with an ``invariant`` attribute, run in the invariant mode when that is true (a
    trainer's step: each rank's trainer was told, none inherits the mode from its parent)."""
    @functools.wraps(method)
    def run_in_mode(self, *args, **kwargs):
        with invariant(self.invariant):
            return method(self, *args, **kwargs)
    return run_in_mode


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def validate(layout, cfg, batch: int, seq: int, *, moe: bool = False) -> None:
    """Raise ValueError, before any process starts, for a run the invariant mode cannot make bitwise: a split
    whose chunks would not be subtrees of the canonical tree (sizes not powers of two), or a part it does not
    cover (context parallelism, ZeRO, MoE, dropout)."""
    for what, n in (("dp", layout.dp), ("tp", layout.tp), ("micro_batches", layout.micro_batches),
                    ("the batch rows", batch), ("the sequence length", seq), ("n_embd", cfg.n_embd),
                    ("ffn_hidden", cfg.ffn_hidden), ("vocab_size", cfg.vocab_size)):
        if not _power_of_two(n):
            raise ValueError(f"--invariant: {what} = {n} is not a power of two, so its chunks are not subtrees "
                             f"of the canonical summation tree (the ranks' partial sums would not line up)")
    refused = {"cp": layout.cp > 1, "zero": layout.zero > 0, "an MoE model": moe,
               "dropout": cfg.dropout > 0}
    for what, present in refused.items():
        if present:
            raise ValueError(f"--invariant does not cover {what} yet: use it without")


class MicroBatchGradients:
    """Gradient accumulation over micro-batches as a tree, not a running ``.grad +=``: in the mode, a hook
    takes each micro-batch's gradient out of ``.grad`` as soon as it is accumulated (backwards run in
    micro-batch order), and :meth:`finish` puts :func:`minipar.canonical.tree_sum` of them back — a subtree of
    the token tree, as one device's single batch builds it."""

    def __init__(self, params):
        self.params = list(params)
        self.parts = {id(p): [] for p in self.params}
        self.handles = [p.register_post_accumulate_grad_hook(self._take) for p in self.params]

    def _take(self, p) -> None:
        if active():
            self.parts[id(p)].append(p.grad)
            p.grad = None

    def finish(self) -> None:
        import torch
        from .canonical import tree_sum
        for p in self.params:
            parts = self.parts[id(p)]
            if parts:
                p.grad = tree_sum(torch.stack(parts))
                parts.clear()

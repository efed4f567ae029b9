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
(1/dp, 1/m, a mean over 2^k tokens) is exact, so the losses and every parameter after any number of AdamW
steps are ``torch.equal`` to one device's in the same mode. PP stages only move work: nothing to change.

The reference is the same program on one device in the same mode: the default mode's own numbers differ
from the invariant mode's in the last bits (another order), and no layout of the default mode equals it.

Cost (measured, tests/test_invariant.py's model: 2 layers, hidden 32, vocab 64, batch 8 × seq 16, float32,
one CPU thread per rank): a one-device step takes about 9× the default mode's time (every product is formed
elementwise before its tree sum: no BLAS), and every all-reduce becomes an all-gather — (t−1)·S bytes sent per
rank instead of a ring's 2(t−1)/t·S, t/2 times more (dp 2 × tp 2: 1.0× the tp bytes at t = 2; 2× at t = 4).
Production systems pay less: batch-invariant kernels fix a tile order inside BLAS instead of forgoing it.

``minipar.invariant()`` is a context manager (a ``ContextVar``, like :func:`minipar.hooks.installed`: scoped
to this thread's block, no global, no environment variable); :func:`active` says whether it is on. Ranks are
separate processes: a trainer takes ``invariant=True`` as an argument and enters the mode itself in each
rank (:class:`minipar.hybrid.parallel3d.Trainer3D`), so nothing is inherited by accident.
"""
from __future__ import annotations

import contextlib
import contextvars

__all__ = ["invariant", "active", "validate"]

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


invariant.active = active       # minipar.invariant.active(), beside minipar.invariant() itself


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

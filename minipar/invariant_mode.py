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
with SP and the vocabulary-parallel loss, dp 2 × tp 2, dp 2 × pp 2 × tp 2, cp 2 by ring and by Ulysses; 3
steps). PP stages only move work: nothing to change. Not covered yet, and refused before launch
(:func:`validate`): ZeRO, MoE, dropout, zig-zag and ring-self-attention cp.

Context parallelism splits every row's positions: cp rank r holds chunk r of each row. One device's token
tree has the rows outermost (dp and micro-batches split rows), so a rank's sum over its tokens is no subtree;
each token sum (every weight gradient, the loss) keeps per-row partials, all-gathers them over the cp group
and finishes each row's tree over the ranks, then the rows' (:func:`minipar.canonical.token_sum`, given the
group by the trainer: ``invariant(True, cp_group)``). Every cp rank then holds the micro-batch's whole
gradient, so the dp × cp reducer's tree adds cp equal copies — exact (x + x = 2x), then ÷ dp·cp. Attention's
sums over keys: the ring's blocks merged by log-sum-exp are another order, so in the mode the ring gathers K
and V in key order instead and every query row runs one device's canonical attention over all s keys; dK and
dV (sums over the queries, a subtree on each rank) finish by an all-to-all and the tree over the ranks
(:func:`minipar.canonical.context_parallel_attention`). Ulysses attends to whole sequences: canonical as is.

The reference is the same program on one device in the same mode (the default mode's numbers are another
order's: equal to the invariant mode's only within a tolerance).

Cost, measured (gpt_recipe: 2 layers, hidden 32, vocab 64, batch 8 × seq 16, float32, AdamW; gloo, one CPU
thread per rank; median step over steps 2-6 and the ranks, on a shared 2-core machine, so ±30 %):

    layout                  step, default → invariant     bytes per rank per step (model), default → invariant
    one device, m 1         12 ms → 47 ms (3.8×)          —
    dp 2 × tp 2, m 2        54 ms → 135 ms (2.5×)         dp 64 KB → 64 KB (1×), tp 83 KB → 115 KB (1.4×)
    dp 4                    92 ms → 62 ms (noise)         dp 184 KB → 367 KB (2×)
    tp 4 + SP               184 ms → 175 ms (noise)       tp 318 KB → 1005 KB (3.2×)
    cp 2 (ring), m 1        35 ms → 82 ms (2.3×)          cp 131 KB → 1028 KB (7.8×), dp 120 KB → 120 KB (1×)

(cp 2: four runs, medians over steps 2-11: default 31, 33, 37, 38 ms; invariant 48, 66, 99, 289 ms — the
machine's load of the moment; the row gives the middle two's mean.)

Time: every product is formed elementwise and summed by the tree (no BLAS). Bytes: an all-reduce becomes an
all-gather, (n−1)·S sent per rank instead of a ring's 2(n−1)/n·S (n/2 times: equal at n = 2), and a fused QKV
layer's f runs once per part. cp: every token sum all-gathers per-row partials, rows × Ψ per micro-batch
(8 × 120 KB here: 963 KB), while attention sends less than the ring (66 KB instead of 131: K and V gathered
once and kept, dK and dV by one all-to-all, at the price of holding the whole sequence's K and V); the dp × cp
reducer adds equal copies (one over dp alone would send nothing here). Production systems pay less:
batch-invariant kernels fix the tile order inside the GEMM instead of forgoing it, and a fixed-order (tree)
all-reduce keeps a reduce-scatter's bytes.

``minipar.invariant()`` is a context manager (a ``ContextVar``, like :func:`minipar.hooks.installed`: scoped
to this thread's block, no global, no environment variable); :func:`active` says whether it is on, and
:func:`cp_group` which cp group it was entered with. Ranks are separate processes: a trainer takes
``invariant=True`` as an argument and enters the mode itself in each rank, with its own cp group
(:class:`minipar.hybrid.parallel3d.Trainer3D`), so nothing is inherited by accident.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from .tree import tree_sum

__all__ = ["invariant", "active", "cp_group", "in_own_mode", "validate", "MicroBatchGradients"]

_on: contextvars.ContextVar = contextvars.ContextVar("minipar_invariant", default=False)
_cp_group: contextvars.ContextVar = contextvars.ContextVar("minipar_invariant_cp_group", default=None)


@contextlib.contextmanager
def invariant(on: bool = True, cp_group=None):
    """Inside the block (``on=True``) every split reduction runs in the canonical order; ``on=False``: the
    default mode inside the block, whatever is outside. ``cp_group``: the context-parallel group whose ranks
    hold chunks of every row's positions (a trainer with cp > 1 passes its own): every sum over tokens
    finishes over it, row by row (:func:`minipar.canonical.token_sum`)."""
    tokens = _on.set(bool(on)), _cp_group.set(cp_group if on else None)
    try:
        yield
    finally:
        _cp_group.reset(tokens[1])
        _on.reset(tokens[0])


def active() -> bool:
    """Whether the invariant mode is on here."""
    return _on.get()


def cp_group():
    """The context-parallel group the mode was entered with here (None: every row's positions are here)."""
    return _cp_group.get()


def in_own_mode(method):
    """A method of an object with ``invariant`` and ``cp_group`` attributes, run in the invariant mode (over
    that cp group) when ``invariant`` is true (a trainer's step: each rank's trainer was told, none inherits
    the mode from its parent)."""
    @functools.wraps(method)
    def run_in_mode(self, *args, **kwargs):
        with invariant(self.invariant, self.cp_group):
            return method(self, *args, **kwargs)
    return run_in_mode


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def validate(layout, cfg, batch: int, seq: int, *, moe: bool = False) -> None:
    """Raise ValueError, before any process starts, for a run the invariant mode cannot make bitwise: a split
    whose chunks would not be subtrees of the canonical tree (sizes not powers of two), or a part it does not
    cover (ZeRO, MoE, dropout, zig-zag or ring-self-attention context parallelism)."""
    for what, n in (("dp", layout.dp), ("tp", layout.tp), ("cp", layout.cp), ("micro_batches", layout.micro_batches),
                    ("the batch rows", batch), ("the sequence length", seq), ("n_embd", cfg.n_embd),
                    ("ffn_hidden", cfg.ffn_hidden), ("vocab_size", cfg.vocab_size)):
        if not _power_of_two(n):
            raise ValueError(f"--invariant: {what} = {n} is not a power of two, so its chunks are not subtrees "
                             f"of the canonical summation tree (the ranks' partial sums would not line up)")
    refused = {"zero": layout.zero > 0, "an MoE model": moe, "dropout": cfg.dropout > 0,
               f"cp_method {layout.cp_method!r} (only 'ring' — contiguous chunks, K and V gathered in key order — "
               f"and 'ulysses')": layout.cp > 1 and layout.cp_method not in ("ring", "ulysses")}
    for what, present in refused.items():
        if present:
            raise ValueError(f"--invariant does not cover {what} yet: use it without")


class MicroBatchGradients:
    """Gradient accumulation over micro-batches as a tree, not a running ``.grad +=``: in the mode, a hook
    takes each micro-batch's gradient out of ``.grad`` as soon as it is accumulated (backwards run in
    micro-batch order), and :meth:`finish` puts :func:`minipar.tree.tree_sum` of them back — a subtree of
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
        for p in self.params:
            parts = self.parts[id(p)]
            if parts:
                p.grad = tree_sum(torch.stack(parts))
                parts.clear()

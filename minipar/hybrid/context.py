"""Context parallelism inside each pipeline stage of the hybrid trainer (chapter 06b's methods on the mesh's
cp groups; Megatron-Core's context parallelism, Korthikanti et al. 2022 §4 and the ring / Ulysses papers
cited in :mod:`minipar.sequence`).

Each of the cp ranks of a stage holds s/cp tokens of every row of its micro-batches (zig-zag: its two
chunks, chunk r and 2·cp−1−r), embeds them at their *global* positions through the model's embedding seam,
and runs attention with the method's core over ``mesh.group("cp")`` (the projections, the MLP, LayerNorms,
the head and the loss act token by token, so they run on the shard as they are). Every rank's loss is the
mean over its own s/cp tokens; all hold the same number of tokens, so the mean of the dp·cp ranks' losses is
the global token mean, and averaging the gradients over ``group("dp", "cp")`` (DDP's reducer, or ZeRO-1's
reduce-scatter over dp × cp) gives its gradient::

    ∇ (1/(dp·cp)) Σ_d Σ_c mean_{tokens of (d, c)} ℓ = ∇ mean_{all tokens} ℓ

In the invariant mode (:mod:`minipar.invariant_mode`; ring and Ulysses) the trainer enters the mode with its cp
group: every token sum (the weight gradients, the loss) finishes row by row over it, and the ring gathers K and
V in key order instead of passing blocks, so the run is one device's bit for bit.

Bytes per rank per step of the cp group (b = 8 bytes in float64, mb rows, s sequence, h/t local width,
L_r blocks on this rank, m micro-batches): ``m · L_r · (forward + backward bytes of the method)``, from
:mod:`minipar.sequence.ring_attention`, :mod:`.ulysses` (its backward moves as much as its forward) and
:mod:`.ring_self_attention`; full recomputation runs every forward twice.
"""
from __future__ import annotations

from ..models import set_attention_core
from ..sequence import context_parallel, ring_attention, ring_self_attention, ulysses

__all__ = ["METHODS", "validate", "install", "cp_bytes"]

METHODS = context_parallel.METHODS      # ring, ring-zigzag, ulysses, rsa


def validate(layout, cfg, seq_len: int) -> None:
    """ValueError, before any process starts, for a cp layout that cannot work (the reason named): chapter
    06b's rule (:func:`minipar.sequence.context_parallel.check_split`) on the cp group, and sequence
    parallelism's split of each cp rank's tokens over tp."""
    cp, tp = layout.cp, layout.tp
    context_parallel.check_split(layout.cp_method, seq_len=seq_len, n_head=cfg.n_head, cp=cp,
                                 dropout=cfg.dropout, tp=tp)
    if cp > 1 and layout.sp and (seq_len // cp) % tp:
        raise ValueError(f"sequence parallelism splits each cp rank's {seq_len // cp} tokens over tp = {tp}: "
                         f"use a sequence length divisible by cp · tp = {cp * tp}")


def install(model, mesh, layout, seq_len: int):
    """Give ``model`` (its attention layers; the reference, before it is split, so that its tensor-parallel
    layers take the core along) the method's core over the cp group; return the global positions of this
    rank's tokens, which every stage embeds (None when cp = 1: nothing changes)."""
    if layout.cp == 1:
        return None
    set_attention_core(model, context_parallel.attention_for(layout.cp_method, mesh.group("cp")))
    return context_parallel.local_positions(seq_len, mesh.coord("cp"), layout.cp, layout.cp_method)


def cp_bytes(cfg, layout, *, micro_batch: int, seq: int, blocks: int, element_size: int = 8) -> float:
    """Bytes one rank sends over its cp group per step: m micro-batches × its ``blocks`` attention layers ×
    the method's forward + backward bytes on (micro_batch, seq, n_embd / tp)."""
    cp, method = layout.cp, layout.cp_method
    if cp == 1:
        return 0
    args = (micro_batch, seq, cfg.n_embd // layout.tp, cp, element_size)
    if method == "ulysses":
        forward, backward = ulysses.forward_bytes(*args), ulysses.forward_bytes(*args)
    else:
        module = ring_self_attention if method == "rsa" else ring_attention
        forward, backward = module.forward_bytes(*args), module.backward_bytes(*args)
    forward *= 2 if layout.recompute == "full" else 1
    return layout.micro_batches * blocks * (forward + backward)

"""What one transformer layer keeps for the backward pass: the one activation-bytes formula.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (§4, eq. 2–4 and
Table 2), with s = sequence length, b = micro-batch, h = hidden size, a = heads, t = tensor-parallel
degree, 16-bit values and 1-byte dropout masks::

    no parallelism    sbh (34 + 5as/h)
    TP                sbh (10 + 24/t + 5as/(ht))
    TP + SP           sbh (34/t + 5as/(ht))
    selective         the same without the as²b terms (softmax out, its dropout out and mask): 34·sbh at t = 1
    full              the layer's input only: 2·sbh (2·sbh/t under SP, where the input is a sequence shard)

With β bytes per value and μ per mask element the counts are sbh·(16β + 2μ) + as²b·(2β + μ) at t = 1;
without dropout sbh·16β + as²b·β (no masks, no dropout outputs). Chapter 06 (sequence parallelism) and
chapter 11 (recomputation) measure against it, and the planner (:mod:`minipar.plan.model`) builds on it.
"""
from __future__ import annotations

__all__ = ["MODES", "activation_elements", "activation_bytes_formula"]

MODES = ("none", "selective", "full")       # recomputation: keep everything, drop the attention core, keep the input


def activation_elements(s, b, h, a, t=1, sequence_parallel=False, dropout=True) -> dict:
    """Per layer, what autograd keeps (Korthikanti et al. 2022 §4.1), as element counts:
    ``{"values": activations, "masks": dropout-mask elements}``.

    Attention: LN input sbh, QKV input sbh, Q and K 2sbh, softmax output as²b, its dropout output as²b,
    V sbh, projection input sbh, dropout mask after the projection sbh and after the softmax as²b.
    MLP: LN input sbh, fc input sbh, GeLU input 4sbh, proj input 4sbh, dropout mask sbh.
    TP divides what lives inside the parallel regions; SP divides the rest (LN and dropout) too.
    Without dropout the masks and the attention's dropout output are not kept.
    """
    sbh, as2b = s * b * h, a * s * s * b
    # inside the parallel regions: Q, K; V; attention-projection input; GeLU input; MLP-projection input
    split = 2 * sbh + sbh + sbh + 4 * sbh + 4 * sbh + (2 if dropout else 1) * as2b
    whole = 2 * sbh + 2 * sbh                  # the two LN inputs; the QKV and fc inputs
    masks_split = as2b if dropout else 0
    masks_whole = 2 * sbh if dropout else 0
    rest_divisor = t if sequence_parallel else 1
    return {"values": split / t + whole / rest_divisor, "masks": masks_split / t + masks_whole / rest_divisor}


def activation_bytes_formula(s, b, h, a, *, t=1, sequence_parallel=False, recompute="none", value_bytes=2,
                             mask_bytes=1, dropout=True) -> float:
    """Bytes one layer keeps for backward on one tensor-parallel rank: the paper's constants for
    ``value_bytes=2, mask_bytes=1`` (CUDA's fused dropout keeps a 1-byte mask; PyTorch's CPU dropout keeps its
    mask as a scaled tensor of the activation dtype, so ``mask_bytes=value_bytes`` there). ``recompute``:
    one of :data:`MODES`; ``dropout=False``: no masks and no dropout outputs."""
    if recompute not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {recompute!r}")
    if recompute == "full":
        return value_bytes * s * b * h / (t if sequence_parallel else 1)     # only the layer's input
    e = activation_elements(s, b, h, a, t, sequence_parallel, dropout)
    total = e["values"] * value_bytes + e["masks"] * mask_bytes
    if recompute == "selective":                         # the attention core's as²b terms are recomputed
        per_as2b = (2 * value_bytes + mask_bytes) if dropout else value_bytes
        total -= per_as2b * a * s * s * b / t
    return total

"""MXFP8: FP8 values in blocks of 32 that share one power-of-two scale (OCP Microscaling, MX v1.0).

Source: Open Compute Project, *OCP Microscaling Formats (MX) Specification*, v1.0 (2023), §5 (the concrete MX
formats) and §6.3 (conversion from higher precision). An MX block is k = 32 consecutive elements along the
contraction dimension, each an FP8 value P_i (E4M3 or E5M2), with one shared scale X stored in **E8M0**: an
8-bit exponent (bias 127, 2^-127 to 2^127, 0xFF = NaN), no sign, no fraction. The conversion of a block:

    X = 2^(floor(log2(amax)) − emax_elem),     P_i = fp8(v_i / X)  (saturated to ±max_elem),     v_i ≈ X · P_i

emax_elem is the exponent of the element format's largest normal: 8 for E4M3 (448 = 1.75·2^8), 15 for E5M2
(57344 = 1.75·2^15). So amax / X lies in [2^emax, 2^(emax+1)) = [256, 512) for E4M3: the block's largest
value gets the element format's top exponent, and one above max_elem (448 < amax / X < 512) is clipped to it
— the spec's rule. (NVIDIA's cuBLAS recipe rounds the exponent up instead, X = 2^ceil(log2(amax / max_elem)):
nothing clips, and up to one binade of the small values is given away.)

Against DeepSeek-V3's recipe (:mod:`minipar.precision.fp8`: 1×128 activation tiles and 128×128 weight blocks
with FP32 scales amax / 448): blocks 4× shorter, both operands tiled along K, and a scale that is a power of
two — applying it is an exponent add, done by the tensor cores themselves on Blackwell-class GPUs — at the price
of a scale up to 2× coarser than amax / 448 (the block's largest value lands in [256, 448], not on 448).
Storage: 8 bits per element + 8 per 32 = 8.25 bits.

Here the MX tensor is a :class:`~minipar.precision.fp8.Quantized` with ``block = (1, 32)`` whose FP32 scales are
exact powers of two (:func:`e8m0_codes` gives their E8M0 bytes); its GEMM is emulated by dequantizing.
"""
from __future__ import annotations

import math

import torch

from .formats import E4M3, format_of
from .fp8 import Quantized, block_amax

__all__ = ["MX_BLOCK", "E8M0_BIAS", "element_emax", "e8m0_scale", "quantize_mx", "e8m0_codes", "bits_per_element",
           "mx_gemm_error"]

MX_BLOCK = 32          # k, the block size of every concrete MX format (spec §5)
E8M0_BIAS = 127        # E8M0: value = 2^(code − 127), codes 0 … 254; 255 is NaN


def element_emax(fmt=E4M3) -> int:
    """emax_elem: the exponent of the element format's largest normal value (E4M3: 8, E5M2: 15)."""
    return math.floor(math.log2(format_of(fmt).max))


def e8m0_scale(amax: torch.Tensor, fmt=E4M3) -> torch.Tensor:
    """X = 2^(floor(log2(amax)) − emax_elem) per block, as FP32 (exact: a power of two), its exponent clamped
    to E8M0's [−127, 127]. A block of zeros gets the smallest scale, 2^-127 (its elements are 0 anyway).
    floor(log2(amax)) is read from the float's exponent (frexp: amax = m · 2^e, 0.5 ≤ m < 1), not from a
    rounded log2."""
    amax = amax.float()
    _, exponent = torch.frexp(amax)
    unbiased = (exponent - 1 - element_emax(fmt)).clamp(-E8M0_BIAS, E8M0_BIAS)
    unbiased = torch.where(amax > 0, unbiased, torch.full_like(unbiased, -E8M0_BIAS))
    return torch.ldexp(torch.ones_like(amax), unbiased)


def quantize_mx(x: torch.Tensor, fmt=E4M3, block: int = MX_BLOCK) -> Quantized:
    """MX quantization of the 2-D ``x`` along its last dimension (the GEMM's K): blocks of 1 × ``block``, each
    with the E8M0 scale of :func:`e8m0_scale` and its elements P = fp8(x / X), saturated to ±max_elem. The
    last block of a row may be partial (padded with zeros for its amax)."""
    fmt = format_of(fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize_mx takes a 2-D tensor, got shape {tuple(x.shape)}")
    if block < 1:
        raise ValueError(f"block must be positive, got {block}")
    scale = e8m0_scale(block_amax(x, (1, block)), fmt)
    expanded = Quantized(x, scale, (1, block)).expanded_scale()
    data = (x.detach().float() / expanded).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return Quantized(data, scale, (1, block))


def e8m0_codes(q: Quantized) -> torch.Tensor:
    """The scales as the bytes an MX tensor stores: uint8 code = log2(X) + 127."""
    return q.scale.to(torch.float8_e8m0fnu).view(torch.uint8)


def bits_per_element(block: int = MX_BLOCK, element_bits: int = 8, scale_bits: int = 8) -> float:
    """Storage of an MX tensor per element: the element plus its share of the block's scale."""
    return element_bits + scale_bits / block


def mx_gemm_error(x: torch.Tensor, w: torch.Tensor, keep=None, fmt=E4M3, block: int = MX_BLOCK) -> float:
    """Relative error of the MXFP8 product x @ wᵀ against FP64, mean |y_mx − y_64| / mean |y_64|: both operands
    in 1 × ``block`` blocks along K (``w`` stored like ``nn.Linear.weight``, out × in). ``keep``: as in
    :func:`minipar.precision.fp8.gemm_error`, measure only what those channels of K contribute."""
    xq, wq = quantize_mx(x, fmt, block), quantize_mx(w, fmt, block)
    keep = torch.ones(x.shape[1], dtype=torch.bool) if keep is None else keep
    exact = x[:, keep].double() @ w[:, keep].double().t()
    got = xq.dequantize()[:, keep].double() @ wq.dequantize()[:, keep].double().t()
    return float((got - exact).abs().mean() / exact.abs().mean())

"""Accumulation precision: a dot product whose running sum keeps only k mantissa bits.

An FP8 GEMM multiplies exactly, but adds the products into an accumulator of limited width. DeepSeek-V3
(2024, §3.3.2) reports that H800 tensor cores keep about 14 bits of the running sum, that the error of a
K = 4096 dot product reaches ~2 %, and fixes it by **promotion**: every N_C = 128 elements (4 WGMMAs) the
partial sum is added into an FP32 accumulator on the CUDA cores and the tensor-core sum restarts from 0.

The emulator, in float64 so that only the modelled rounding happens:

    partial ← round_k(partial + p_i)                       for every product p_i
    every N_C products (with promotion):  total ← fp32(total + partial),  partial ← 0
    result = fp32(total + partial)

round_k keeps k fraction bits (k + 1 significant bits with the leading 1), rounding to nearest, ties to even.
Why it grows: each addition rounds with error up to 2^-(k+1)·|partial|, and |partial| grows with the number
of terms in it; promotion bounds that number by N_C, so the error stops growing with K. (A model of the
hardware, which truncates rather than rounds: the shape, not the exact percentages, is what carries over.)
"""
from __future__ import annotations

import torch

from .formats import E4M3

__all__ = ["round_mantissa", "accumulate", "fp8_dot_products", "accumulation_error"]


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` (float64) rounded to ``bits`` fraction bits, ties to even; the exponent is unlimited."""
    if bits < 0:
        raise ValueError(f"bits must be >= 0, got {bits}")
    mantissa, exponent = torch.frexp(x)                   # x = mantissa · 2^exponent, 0.5 <= |mantissa| < 1
    step = 2.0 ** (bits + 1)
    return torch.ldexp(torch.round(mantissa * step) / step, exponent)


def accumulate(products: torch.Tensor, bits: int, promote_every: int | None = None) -> torch.Tensor:
    """Sum ``products`` over the last dimension, one at a time, keeping the running sum to ``bits`` fraction
    bits; with ``promote_every`` = N_C, flush it into an FP32 total every N_C products."""
    if promote_every is not None and promote_every < 1:
        raise ValueError(f"promote_every must be positive, got {promote_every}")
    products = products.double()
    partial = torch.zeros(products.shape[:-1], dtype=torch.float64)
    total = torch.zeros_like(partial)
    for i in range(products.shape[-1]):
        partial = round_mantissa(partial + products[..., i], bits)
        if promote_every is not None and (i + 1) % promote_every == 0:
            total, partial = (total + partial).float().double(), torch.zeros_like(partial)
    return (total + partial).float().double()


def fp8_dot_products(k: int, n: int = 256, seed: int = 0, positive: bool = False) -> torch.Tensor:
    """(n, k) elementwise products of two E4M3 vectors drawn from N(0, 1) (|N(0, 1)| if ``positive``), the
    terms an FP8 GEMM adds up (each product of two E4M3 values is exact in float64)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, n, k, generator=g, dtype=torch.float64)
    if positive:
        a, b = a.abs(), b.abs()
    return a.to(E4M3.dtype).double() * b.to(E4M3.dtype).double()


def accumulation_error(k: int, bits: int = 13, promote_every: int | None = None, n: int = 256, seed: int = 0,
                       positive: bool = False) -> float:
    """Relative error of :func:`accumulate` against the float64 sum of the same products, over n dot products
    of length ``k``: mean |approx - exact| / mean |exact|."""
    products = fp8_dot_products(k, n, seed, positive)
    exact = products.sum(-1)
    return float((accumulate(products, bits, promote_every) - exact).abs().mean() / exact.abs().mean())

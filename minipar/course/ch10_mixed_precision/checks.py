"""Checks for chapter 10's exercises: decode a float's bits by hand, and the dynamic loss scaler's rule.

* :func:`check_decode` compares the learner's ``decode(bits, exponent_bits, mantissa_bits)`` with what torch
  stores for thousands of bit patterns of FP16, BF16 and FP32 (normals, subnormals, zeros, infs, NaNs).
* :func:`check_scaler_update` runs the learner's ``scaler_update`` and ``torch.amp.GradScaler`` side by side
  on the same sequence of clean and overflowing steps: same decision, same scale, every step.
"""
from __future__ import annotations

import math

import torch

from minipar.course.checks import fail

__all__ = ["check_decode", "check_scaler_update", "bit_patterns"]

_LAYOUTS = {"FP16": (5, 10, torch.float16, torch.int16), "BF16": (8, 7, torch.bfloat16, torch.int16),
            "FP32": (8, 23, torch.float32, torch.int32)}


def bit_patterns(name: str, n: int = 2000, seed: int = 0) -> list:
    """Random bit patterns of a format plus the special ones (zeros, the smallest subnormal, max, inf, NaN)."""
    e, m, _, _ = _LAYOUTS[name]
    bits = 1 + e + m
    g = torch.Generator().manual_seed(seed)
    pats = torch.randint(0, 2 ** bits, (n,), generator=g, dtype=torch.int64).tolist()
    top = (2 ** e - 1) << m
    special = [0, 1 << (bits - 1), 1, 2 ** m - 1, 1 << m, top - 1, top, top | 1, (1 << (bits - 1)) | top,
               (2 ** (e - 1) - 1) << m]
    return special + pats


def _torch_value(bits: int, name: str) -> float:
    e, m, dtype, itype = _LAYOUTS[name]
    width = 1 + e + m
    signed = bits - 2 ** width if bits >= 2 ** (width - 1) else bits
    return float(torch.tensor([signed], dtype=itype).view(dtype).double().item())


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return float(a) == float(b) and math.copysign(1, float(a)) == math.copysign(1, float(b))
    except (TypeError, ValueError):
        return False


def check_decode(decode) -> None:
    """``decode(bits, exponent_bits, mantissa_bits)`` -> the float the bit pattern (an int) stands for."""
    for name, (e, m, _, _) in _LAYOUTS.items():
        for bits in bit_patterns(name):
            want = _torch_value(bits, name)
            got = decode(bits, e, m)
            if not _same(got, want):
                _diagnose_decode(name, bits, e, m, got, want)
    print("decode: every tested bit pattern of FP16, BF16 and FP32 gives exactly the value torch stores "
          "(normals, subnormals, ±0, ±inf, NaN)")


def _diagnose_decode(name, bits, e, m, got, want):
    width = 1 + e + m
    exp = (bits >> m) & (2 ** e - 1)
    what = f"decode({bits:#0{width // 4 + 2}x}) as {name} (bits {bits:0{width}b})"
    if got is None:
        fail(what, want, got, "return the value (a float)")
    if exp == 0:
        fail(what, want, got, "an exponent field of 0 is zero or a subnormal: no implicit leading 1, and the "
                              "exponent is 1 - bias, not 0 - bias")
    if exp == 2 ** e - 1:
        fail(what, want, got, "an exponent field of all ones means inf (fraction 0) or NaN (fraction ≠ 0)")
    if isinstance(got, (int, float)) and want and not math.isnan(want) and got and abs(got / want) in (2.0, 0.5):
        fail(what, want, got, "off by a factor of 2: the bias is 2^(e-1) - 1 (15 for FP16, 127 for FP32/BF16)")
    if isinstance(got, (int, float)) and want and abs(got) == abs(want):
        fail(what, want, got, "wrong sign: the sign is the top bit, bit number e + m")
    fail(what, want, got, "value = (-1)^s · 2^(E - bias) · (1 + M / 2^m) for a normal number")


def _scales_with_gradscaler(pattern, kw):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **kw)
    out = []
    for overflow in pattern:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if overflow:
            p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        out.append((not overflow, scaler.get_scale()))
    return out


def check_scaler_update(scaler_update) -> None:
    """``scaler_update(scale, good_steps, overflow, growth_factor, backoff_factor, growth_interval)`` ->
    ``(take_step, new_scale, new_good_steps)``: the same decisions and scales as ``torch.amp.GradScaler``."""
    g = torch.Generator().manual_seed(3)
    cases = [([False] * 7, dict(init_scale=2.0 ** 16, growth_interval=3)),
             ([False, True, False, False, True, True, False, False, False, False],
              dict(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)),
             ((torch.rand(40, generator=g) < 0.25).tolist(), dict(init_scale=2.0 ** 16, growth_interval=3))]
    for pattern, kw in cases:
        want = _scales_with_gradscaler(pattern, kw)
        scale, good = kw["init_scale"], 0
        for i, overflow in enumerate(pattern):
            res = scaler_update(scale, good, overflow, kw.get("growth_factor", 2.0), kw.get("backoff_factor", 0.5),
                                kw["growth_interval"])
            if not (isinstance(res, tuple) and len(res) == 3):
                fail("scaler_update's result", "(take_step, new_scale, new_good_steps)", res, "return a 3-tuple")
            take, scale, good = res
            want_take, want_scale = want[i]
            what = (f"step {i} of {['overflow' if o else 'clean' for o in pattern[:i + 1]][-6:]} "
                    f"(growth_interval={kw['growth_interval']})")
            if bool(take) != want_take:
                fail(what + ": step taken?", want_take, take, "skip the optimizer step exactly when the "
                     "gradients overflowed (inf/NaN); take it otherwise")
            if scale != want_scale:
                fail(what + ": scale afterwards", want_scale, scale, _scale_mistake(pattern[:i + 1], kw))
    print("scaler_update: same decision and same scale as torch.amp.GradScaler at every step of 3 sequences")


def _scale_mistake(history, kw) -> str:
    if history[-1]:
        return ("on overflow multiply the scale by backoff_factor and reset the run of good steps to 0 "
                "(otherwise the next growth comes too early)")
    return ("grow by growth_factor when the run of clean steps reaches growth_interval (not one step later), "
            "then start counting from 0 again; an overflow resets the count")

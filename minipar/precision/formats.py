"""What a floating-point format can represent, computed from its bit layout alone.

A binary float with ``e`` exponent bits and ``m`` mantissa (fraction) bits stores a sign ``s``, a biased
exponent ``E`` and a fraction ``M`` (IEEE 754; BF16 keeps the same rules with FP32's exponent):

* normal (0 < E < 2^e - 1):   (-1)^s · 2^(E - bias) · (1 + M / 2^m),   bias = 2^(e-1) - 1
* subnormal (E = 0):          (-1)^s · 2^(1 - bias) · (M / 2^m)         (gradual underflow down to 0)
* E = 2^e - 1:                ±inf when M = 0, NaN otherwise

From which: largest = (2 - 2^-m) · 2^bias, smallest normal = 2^(1-bias), smallest subnormal = 2^(1-bias-m),
epsilon (the gap after 1.0) = 2^-m, and the gap between neighbours near x is 2^(floor(log2|x|) - m).

    FP32 1/8/23  max 3.4e38   tiny 1.2e-38  subnormal 1.4e-45  eps 1.2e-7   (~7.2 decimal digits)
    FP16 1/5/10  max 65504    tiny 6.1e-5   subnormal 6.0e-8   eps 9.8e-4   (~3.3 decimal digits)
    BF16 1/8/7   max 3.4e38   tiny 1.2e-38  subnormal 9.2e-41  eps 7.8e-3   (~2.4 decimal digits)
    E4M3 1/4/3   max 448      tiny 1.6e-2   subnormal 2.0e-3   eps 0.125    (~1.2 decimal digits)
    E5M2 1/5/2   max 57344    tiny 6.1e-5   subnormal 1.5e-5   eps 0.25     (~0.9 decimal digits)

The two FP8 formats are those of Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (the OCP standard).
E5M2 keeps the IEEE rules (FP16's exponent, two fraction bits). E4M3 (torch's ``float8_e4m3fn``, "fn" =
finite, no infinities) gives the all-ones exponent back to normal numbers and keeps only S.1111.111 as NaN:
so its max is 1.75 · 2^8 = 448 instead of IEEE's 240, and there is no inf (torch saturates to ±448 on a cast).

BF16 comes from Google Brain (Wang & Kanwar 2019, used on TPUs); FP16 mixed precision from Micikevicius
et al. 2018, "Mixed Precision Training". The constants here are checked against ``torch.finfo`` in the tests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FloatFormat", "FP32", "FP16", "BF16", "E4M3", "E5M2", "FORMATS", "FP8_FORMATS", "ALL_FORMATS", "format_of", "Decoded", "decompose", "compose",
           "round_to", "spacing", "vanishing_ratio"]


@dataclass(frozen=True)
class FloatFormat:
    name: str
    exponent_bits: int
    mantissa_bits: int
    dtype: torch.dtype
    finite_only: bool = False   # E4M3 ("fn"): the all-ones exponent holds normals, only fraction all ones is NaN

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max(self) -> float:
        """Largest finite value: biased exponent all ones but one, fraction all ones (finite-only formats:
        exponent all ones, fraction all ones but the last bit, the one pattern left to NaN)."""
        if self.finite_only:
            return (2 - 2.0 ** (1 - self.mantissa_bits)) * 2.0 ** (self.bias + 1)
        return (2 - 2.0 ** -self.mantissa_bits) * 2.0 ** self.bias

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """The gap between 1.0 and the next representable value."""
        return 2.0 ** -self.mantissa_bits

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits: log10 of 2^(m+1) (the implicit leading 1 counts)."""
        return (self.mantissa_bits + 1) * math.log10(2)


FP32 = FloatFormat("FP32", 8, 23, torch.float32)
FP16 = FloatFormat("FP16", 5, 10, torch.float16)
BF16 = FloatFormat("BF16", 8, 7, torch.bfloat16)
E4M3 = FloatFormat("E4M3", 4, 3, torch.float8_e4m3fn, finite_only=True)
E5M2 = FloatFormat("E5M2", 5, 2, torch.float8_e5m2)
FORMATS = {f.name: f for f in (FP32, FP16, BF16)}                 # chapter 10's three
FP8_FORMATS = {f.name: f for f in (E4M3, E5M2)}
ALL_FORMATS = {**FORMATS, **FP8_FORMATS}
_INT_OF_WIDTH = {8: torch.int8, 16: torch.int16, 32: torch.int32}


def format_of(fmt) -> FloatFormat:
    """Accept a :class:`FloatFormat`, its name ("FP16") or its torch dtype."""
    if isinstance(fmt, FloatFormat):
        return fmt
    for f in ALL_FORMATS.values():
        if fmt in (f.name, f.name.lower(), f.dtype):
            return f
    raise ValueError(f"unknown float format {fmt!r}; use one of {list(ALL_FORMATS)} or their torch dtypes")


@dataclass(frozen=True)
class Decoded:
    """One value's fields. ``value`` is recomputed from the fields with the formula, not read from torch."""
    fmt: FloatFormat
    sign: int
    exponent: int          # the stored (biased) exponent field
    mantissa: int          # the stored fraction field
    kind: str              # "normal", "subnormal", "zero", "inf" or "nan"
    value: float

    @property
    def bit_string(self) -> str:
        """Sign, exponent and fraction separated by spaces, e.g. ``0 01111 0000000000`` for 1.0 in FP16."""
        e, m = self.fmt.exponent_bits, self.fmt.mantissa_bits
        return f"{self.sign} {self.exponent:0{e}b} {self.mantissa:0{m}b}"


def compose(sign: int, exponent: int, mantissa: int, fmt) -> float:
    """The value of the fields (sign, biased exponent, fraction) under the format's rules."""
    f = format_of(fmt)
    top = 2 ** f.exponent_bits - 1
    if not (0 <= exponent <= top and 0 <= mantissa < 2 ** f.mantissa_bits and sign in (0, 1)):
        raise ValueError(f"fields out of range for {f.name}: sign={sign}, exponent={exponent}, mantissa={mantissa}")
    s = -1.0 if sign else 1.0
    if f.finite_only and exponent == top and mantissa == 2 ** f.mantissa_bits - 1:
        return math.nan
    if exponent == top and not f.finite_only:
        return s * math.inf if mantissa == 0 else math.nan
    fraction = mantissa / 2 ** f.mantissa_bits
    if exponent == 0:                                   # subnormal (or zero): no implicit leading 1
        return s * math.ldexp(fraction, 1 - f.bias)
    return s * math.ldexp(1 + fraction, exponent - f.bias)


def decompose(x, fmt) -> Decoded:
    """Round ``x`` to the format (round to nearest, ties to even) and split its bits into the three fields."""
    f = format_of(fmt)
    t = torch.as_tensor(x, dtype=torch.float64).reshape(1).to(f.dtype)
    raw = int(t.view(_INT_OF_WIDTH[f.bits]).item()) & (2 ** f.bits - 1)   # two's complement -> unsigned
    sign = raw >> (f.bits - 1)
    exponent = (raw >> f.mantissa_bits) & (2 ** f.exponent_bits - 1)
    mantissa = raw & (2 ** f.mantissa_bits - 1)
    if f.finite_only and exponent == 2 ** f.exponent_bits - 1 and mantissa == 2 ** f.mantissa_bits - 1:
        kind = "nan"
    elif exponent == 2 ** f.exponent_bits - 1 and not f.finite_only:
        kind = "inf" if mantissa == 0 else "nan"
    elif exponent == 0:
        kind = "zero" if mantissa == 0 else "subnormal"
    else:
        kind = "normal"
    return Decoded(f, sign, exponent, mantissa, kind, compose(sign, exponent, mantissa, f))


def round_to(x, fmt) -> float:
    """``x`` rounded to the nearest value the format can hold (what ``tensor.to(dtype)`` does)."""
    return float(torch.as_tensor(x, dtype=torch.float64).to(format_of(fmt).dtype).double())


def spacing(x: float, fmt) -> float:
    """The gap between representable values around ``|x|`` (one unit in the last place)."""
    f = format_of(fmt)
    x = abs(x)
    if x < f.smallest_normal:
        return f.smallest_subnormal
    return 2.0 ** (math.floor(math.log2(x)) - f.mantissa_bits)


def vanishing_ratio(w: float, fmt) -> int:
    """The smallest integer ratio r = w/u at which the update u = w/r is lost (w + u == w), measured in the
    format's own arithmetic: w, u and their sum each rounded to the format (round to nearest, ties to even).

    Model: u > 0 is lost when it is below half the gap above w, or exactly half and w's last fraction bit is
    0 (the tie goes to the even neighbour, w itself); so r ≈ 2·w / spacing(w), which depends on where w sits
    in its binade: from 2^(m+1) (w a power of two) up to almost 2^(m+2) (w just below the next one). FP16:
    2048 to 4096, BF16: 256 to 512. (u itself is rounded too, so the measured r can be one or two off.)
    """
    f = format_of(fmt)
    wt = torch.as_tensor(w, dtype=torch.float64).to(f.dtype)
    if not (math.isfinite(float(wt)) and float(wt) >= f.smallest_normal):
        raise ValueError(f"w must be a positive normal {f.name} value; {w!r} rounds to {float(wt)!r}")

    def lost(r: int) -> bool:
        u = (wt.double() / r).to(f.dtype)
        return bool(wt + u == wt)                          # the sum in the format's arithmetic

    lo, hi = 1, 2 ** (f.mantissa_bits + 3)                 # w + w is never w; w + w/2^(m+3) always is
    while hi - lo > 1:                                     # lost(r) is monotone in r: bisect
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if lost(mid) else (mid, hi)
    return hi

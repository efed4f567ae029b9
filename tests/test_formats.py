"""Format constants computed from the bit layout agree with torch.finfo; decoding the bits of a value and
recomputing it from the fields gives back exactly what torch stores."""
import math

import pytest
import torch

from minipar.precision.formats import (ALL_FORMATS, BF16, E4M3, E5M2, FP16, FP32, compose, decompose, format_of,
                                      round_to, spacing)

_INT = {8: torch.int8, 16: torch.int16, 32: torch.int32}


def _next_up(x: float, dtype) -> float:
    """The representable value after positive ``x``: its bit pattern plus one (nextafter, which torch does
    not implement for float8)."""
    t = torch.tensor([x], dtype=torch.float64).to(dtype)
    bits = t.view(_INT[t.element_size() * 8]) + 1
    return float(bits.view(dtype).double())


@pytest.mark.parametrize("name", list(ALL_FORMATS))
def test_constants_match_torch_finfo(name):
    f = ALL_FORMATS[name]
    info = torch.finfo(f.dtype)
    assert f.bits == info.bits
    assert f.max == info.max
    assert f.smallest_normal == info.tiny
    # finfo has no smallest subnormal: it is the value after 0 (nextafter), which torch computes itself
    assert f.smallest_subnormal == _next_up(0.0, f.dtype) > 0
    assert f.eps == info.eps


def test_known_layouts_and_constants():
    assert (FP32.exponent_bits, FP32.mantissa_bits) == (8, 23)
    assert (FP16.exponent_bits, FP16.mantissa_bits) == (5, 10)
    assert (BF16.exponent_bits, BF16.mantissa_bits) == (8, 7)
    assert FP16.max == 65504.0 and FP16.smallest_subnormal == 2.0 ** -24 and FP16.smallest_normal == 2.0 ** -14
    assert BF16.smallest_normal == FP32.smallest_normal          # same exponent, same range
    assert BF16.eps / FP16.eps == 8                                 # 3 fewer mantissa bits
    assert (E4M3.max, E4M3.smallest_normal, E4M3.smallest_subnormal, E4M3.eps) == (448.0, 2.0 ** -6, 2.0 ** -9, 0.125)
    assert (E5M2.max, E5M2.smallest_normal, E5M2.smallest_subnormal, E5M2.eps) == (57344.0, 2.0 ** -14, 2.0 ** -16,
                                                                                 0.25)
    assert E5M2.smallest_normal == FP16.smallest_normal             # E5M2 is FP16 with 8 fraction bits cut off


def test_known_bit_patterns():
    assert decompose(1.0, FP16).bit_string == "0 01111 0000000000"
    assert decompose(-2.5, FP16).bit_string == "1 10000 0100000000"
    assert decompose(65504, FP16).bit_string == "0 11110 1111111111"
    assert decompose(1.0, BF16).bit_string == "0 01111111 0000000"
    assert decompose(1.0, FP32).bit_string == "0 01111111 " + "0" * 23
    assert decompose(65520, FP16).kind == "inf"                     # rounds past max: overflow
    assert decompose(2.0 ** -25, FP16).kind == "zero"              # half the smallest subnormal: ties to even -> 0
    assert decompose(2.0 ** -24, FP16).kind == "subnormal"
    assert decompose(float("nan"), BF16).kind == "nan"
    assert decompose(448, E4M3).bit_string == "0 1111 110"            # the all-ones exponent holds normals
    assert decompose(float("nan"), E4M3).bit_string.endswith("1111 111") and compose(0, 15, 7, E4M3) != 0
    assert decompose(1e6, E4M3).value == 448                          # no inf: torch saturates E4M3 casts
    assert decompose(1e6, E5M2).kind == "inf"                          # E5M2 keeps IEEE's inf
    assert decompose(57344, E5M2).bit_string == "0 11110 11"
    assert decompose(2.0 ** -10, E4M3).kind == "zero"                # half the smallest subnormal 2^-9: ties to 0
    assert decompose(3 * 2.0 ** -11, E4M3).kind == "subnormal"


def _samples():
    g = torch.Generator().manual_seed(0)
    mags = torch.exp2(torch.empty(2000, dtype=torch.float64).uniform_(-150, 130, generator=g))
    signs = torch.where(torch.rand(2000, generator=g) < 0.5, -1.0, 1.0).double()
    specials = [0.0, -0.0, 1.0, 1 / 3, 0.1, 65504.0, 65519.0, 65520.0, 1e-8, 3e-8, 6e-5, 1e-40, 1e-45,
                float("inf"), float("-inf"), 3.4e38, 3.5e38]
    return specials + (mags * signs).tolist()


@pytest.mark.parametrize("name", list(ALL_FORMATS))
def test_decompose_then_compose_is_exactly_torch_rounding(name):
    f = ALL_FORMATS[name]
    for x in _samples():
        d = decompose(x, f)
        want = round_to(x, f)
        assert d.value == want or (math.isnan(want) and math.isnan(d.value)), (x, d, want)
        assert math.copysign(1, d.value) == math.copysign(1, want)
        assert compose(d.sign, d.exponent, d.mantissa, f) == d.value


def test_spacing_is_the_gap_to_the_next_value():
    for f in ALL_FORMATS.values():
        for x in (1.0, 3.0, 100.0, 1e-3, f.smallest_normal, f.smallest_normal / 4):
            assert spacing(x, f) == _next_up(x, f.dtype) - round_to(x, f), (f.name, x)
    assert spacing(2048.0, FP16) == 2.0        # above 2048, FP16 cannot hold odd integers
    assert spacing(300.0, E4M3) == 32.0 and spacing(1.0, E4M3) == 0.125


def test_bad_format_and_fields():
    with pytest.raises(ValueError):
        format_of("fp7")
    with pytest.raises(ValueError):
        compose(0, 32, 0, FP16)


def test_vanishing_ratio_lies_between_two_powers_of_two_and_depends_on_w():
    """An update u = w/r is lost when it falls below half the gap above w: r ≈ 2w/spacing(w), so in FP16 the
    threshold runs from 2^11 (w a power of two) to almost 2^12, not a fixed 2048."""
    from minipar.precision.formats import vanishing_ratio
    assert vanishing_ratio(1.0, FP16) == 2048
    assert 3880 <= vanishing_ratio(1.9, FP16) <= 3900                 # so w/u = 3000 survives at w = 1.9
    fp16 = [vanishing_ratio(w, FP16) for w in (1.0, 1.25, 1.5, 1.75, 1.9, 1.999, 3.0, 100.0)]
    assert all(2 ** 11 <= r <= 2 ** 12 for r in fp16), fp16
    bf16 = [vanishing_ratio(w, BF16) for w in (1.0, 1.5, 1.99)]
    assert all(2 ** 8 <= r <= 2 ** 9 for r in bf16), bf16
    w16 = torch.tensor(1.9, dtype=torch.float16)
    assert w16 + w16 / 3000 != w16 and w16 + w16 / 4000 == w16    # the sweep's claim, in plain torch
    with pytest.raises(ValueError, match="positive normal"):
        vanishing_ratio(0.0, FP16)

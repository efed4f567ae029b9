"""MXFP8 (OCP Microscaling v1.0): the E8M0 scale is 2^(floor(log2 amax) − emax_elem), the quantizer equals a
scalar reference quantizer written from the spec (scales, elements and so the error, bit for bit), the spec's
clipping of 448 < amax / X < 512 happens, and 1×32 blocks keep the small channels beside outliers at least as
well as DeepSeek-V3's 1×128 tiles."""
import math

import pytest
import torch

from minipar.precision.formats import E4M3, E5M2
from minipar.precision.fp8 import gemm_error
from minipar.precision.mxfp8 import (MX_BLOCK, bits_per_element, e8m0_codes, e8m0_scale, element_emax,
                                     mx_gemm_error, quantize_mx)


def _grid(fmt):
    """Every finite value of the FP8 format, decoded from its 256 bit patterns, sorted (no cast involved)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).float()
    return sorted(set(float(v) for v in codes if math.isfinite(float(v))))


def _round_to_grid(v: float, grid: list) -> float:
    """Round to nearest, ties to the value with an even last fraction bit (its index among the non-negative
    values is even), saturating at the ends."""
    if v >= grid[-1] or v <= grid[0]:
        return grid[-1] if v > 0 else grid[0]
    lo = max(g for g in grid if g <= v)
    hi = min(g for g in grid if g >= v)
    if v - lo != hi - v:
        return lo if v - lo < hi - v else hi
    positive = [g for g in grid if g >= 0]
    return lo if positive.index(abs(lo)) % 2 == 0 else hi


def _reference(x: torch.Tensor, fmt, block=MX_BLOCK):
    """The spec's conversion, one block and one value at a time in Python floats."""
    grid, emax = _grid(fmt), {"E4M3": 8, "E5M2": 15}[fmt.name]
    rows, scales = [], []
    for row in x.tolist():
        out, row_scales = [], []
        for start in range(0, len(row), block):
            vals = row[start:start + block]
            amax = max(abs(v) for v in vals)
            X = 2.0 ** (math.frexp(amax)[1] - 1 - emax) if amax > 0 else 2.0 ** -127
            row_scales.append(X)
            out += [_round_to_grid(v / X, grid) for v in vals]
        rows.append(out)
        scales.append(row_scales)
    return torch.tensor(rows, dtype=torch.float64), torch.tensor(scales, dtype=torch.float64)


def _blocks_of_every_size(seed=0, shape=(3, 80)):
    """Rows of 80 (two full blocks of 32 and a partial one), each block at its own magnitude."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    magnitudes = torch.tensor([[1e-3, 1.0, 300.0], [7.0, 0.02, 5e4], [1.0, 1.0, 1.0]])
    return x * magnitudes.repeat_interleave(MX_BLOCK, 1)[:, :shape[1]]


def test_emax_and_storage():
    assert element_emax(E4M3) == 8 and element_emax(E5M2) == 15
    assert bits_per_element() == 8.25


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_e8m0_scale_is_a_power_of_two_from_floor_log2_amax(fmt):
    amax = torch.tensor([1.0, 448.0, 511.9, 512.0, 3.0, 1e-3, 2.0 ** -20, 6.0e4, 0.0])
    emax = element_emax(fmt)
    want = [2.0 ** (math.floor(math.log2(a)) - emax) if a > 0 else 2.0 ** -127 for a in amax.tolist()]
    assert e8m0_scale(amax, fmt).tolist() == want
    ratio = (amax[:-1] / e8m0_scale(amax[:-1], fmt)).tolist()
    assert all(2 ** emax <= r < 2 ** (emax + 1) for r in ratio)          # amax / X in [2^emax, 2^(emax+1))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_quantize_mx_equals_the_reference_quantizer(fmt):
    x = _blocks_of_every_size()
    q = quantize_mx(x, fmt)
    data, scales = _reference(x, fmt)
    assert q.data.dtype == fmt.dtype and q.block == (1, MX_BLOCK) and q.scale.shape == (3, 3)
    assert torch.equal(q.scale.double(), scales)
    assert torch.equal(q.data.double(), data)
    expanded = scales.repeat_interleave(MX_BLOCK, 1)[:, :x.shape[1]]
    error, reference_error = q.dequantize().double() - x.double(), data * expanded - x.double()
    assert torch.equal(error, reference_error)                          # the error, measured against the reference
    normal = (x.abs() / q.expanded_scale() >= fmt.smallest_normal) & (x.abs() / q.expanded_scale() <= fmt.max)
    assert float((error.abs() / x.abs())[normal].max()) <= 2.0 ** -(fmt.mantissa_bits + 1)


def test_the_spec_clips_between_448_and_512():
    x = torch.ones(1, MX_BLOCK)
    x[0, 0] = 500.0                     # X = 2^(8 − 8) = 1; 500 > 448 is clipped (floor rule, spec §6.3)
    x[0, 1] = -300.0
    q = quantize_mx(x)
    assert float(q.scale) == 1.0 and q.data[0, :2].float().tolist() == [448.0, -288.0]
    assert q.saturated == 1
    x[0, 0] = 448.0                     # exactly E4M3's max: no clipping, and the block's largest value on it
    assert float(quantize_mx(x).dequantize()[0, 0]) == 448.0
    x[0, 0] = 256.0                     # the coarse end: amax / X = 256, a binade below E4M3's top
    assert float(quantize_mx(x).data[0, 0].float()) == 256.0


def test_e8m0_codes_and_zero_blocks():
    x = torch.zeros(2, 64)
    x[0, :32] = 3.0                                                     # X = 2^(1 − 8)
    q = quantize_mx(x)
    assert e8m0_codes(q).dtype == torch.uint8
    assert e8m0_codes(q).tolist() == [[127 - 7, 0], [0, 0]]              # a block of zeros: code 0 = 2^-127
    assert torch.equal(q.dequantize(), x)
    with pytest.raises(ValueError, match="2-D"):
        quantize_mx(x.flatten())


def test_mx_keeps_small_channels_beside_outliers():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * 0.05
    x = torch.randn(256, 512, generator=g)
    keep = torch.ones(512, dtype=torch.bool)
    keep[[3, 100, 300]] = False
    assert mx_gemm_error(x, w, keep) < 0.05                             # FP8's floor without outliers
    x[:, ~keep] *= 1e5
    mx, tiles = mx_gemm_error(x, w, keep), gemm_error(x, w, "block", keep=keep)
    tensor = gemm_error(x, w, "tensor", keep=keep)
    assert mx <= tiles < tensor / 3, (mx, tiles, tensor)

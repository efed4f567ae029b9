"""FP8 quantization and GEMMs: the scale is amax / max_fmt (a wrong one is rejected by the same bounds),
``_scaled_mm`` and the emulation agree, fine-grained scales keep the small channels next to outliers, delayed
scaling saturates a spike its history has not seen, FP8Linear's gradients stay within FP8's precision of
FP32's, and the accumulation emulator reproduces DeepSeek-V3's shape (error grows with K; promotion every 128
stops it)."""
import pytest
import torch

from minipar.precision.accumulation import accumulate, accumulation_error, round_mantissa
from minipar.precision.formats import E4M3
from minipar.precision.fp8 import (GRANULARITIES, AmaxHistory, FP8Linear, FP8Recipe, block_amax,
                                   fp8_matmul, gemm_error, quantize, to_fp8)

HALF_ULP_E4M3 = 2.0 ** -4          # round to nearest: relative error <= 2^-(m+1) for normal values


def _x(seed=0, shape=(64, 256)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _max_relative_error(x, dequantized):
    normal = x.abs() >= x.abs().max() / E4M3.max * E4M3.smallest_normal   # lands in E4M3's normal range
    return float(((dequantized - x).abs() / x.abs())[normal].max())


def test_tensor_scale_is_amax_over_448_and_error_within_half_an_ulp():
    x = _x()
    q = quantize(x, E4M3)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (1, 1)
    assert float(q.scale) == pytest.approx(float(x.abs().max()) / 448, rel=1e-7)
    assert float(q.data.float().abs().max()) == 448.0                  # the amax lands on the max
    assert _max_relative_error(x, q.dequantize()) <= HALF_ULP_E4M3


def _wrong_scale_errors(x):
    """Two wrong scales, computed by hand: amax not divided by 448, and the scale applied the wrong way."""
    amax = x.abs().max()
    not_divided = (x / amax).to(E4M3.dtype).float() * amax
    s = amax / 448
    wrong_way = (x * s).clamp(-448, 448).to(E4M3.dtype).float() / s
    return _max_relative_error(x, not_divided), _max_relative_error(x, wrong_way)


def test_the_bound_rejects_a_wrong_scale():
    for err in _wrong_scale_errors(_x()):
        assert err > HALF_ULP_E4M3 * 4, err


def test_block_amax_and_block_scales():
    x = _x(1, (5, 300))
    amax = block_amax(x, (2, 128))
    assert amax.shape == (3, 3)
    assert float(amax[1, 2]) == float(x[2:4, 256:].abs().max())
    q = quantize(x, E4M3, (1, 128))
    assert q.scale.shape == (5, 3) and q.dequantize().shape == x.shape
    assert _max_relative_error(x, q.dequantize()) <= HALF_ULP_E4M3
    with pytest.raises(ValueError, match="2-D"):
        quantize(x.flatten())


def test_scaled_mm_equals_the_emulation():
    x, w = _x(2, (32, 128)), _x(3, (48, 128))
    for block in (None, "row"):
        xq = quantize(x, E4M3, (1, 128) if block else None)
        wq = quantize(w, E4M3, (1, 128) if block else None)
        emulated = xq.dequantize() @ wq.dequantize().t()
        assert torch.allclose(fp8_matmul(xq, wq), emulated, rtol=1e-5, atol=1e-5)


def test_fine_grained_scales_keep_small_channels_beside_outliers():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * 0.05
    keep = torch.ones(512, dtype=torch.bool)
    keep[[3, 100, 300]] = False
    x = torch.randn(256, 512, generator=g)
    plain = [gemm_error(x, w, gr, keep=keep) for gr in GRANULARITIES]
    assert all(e < 0.05 for e in plain), plain                          # no outliers: all about 3.7 %
    x[:, ~keep] *= 1e5
    tensor, row, block = (gemm_error(x, w, gr, keep=keep) for gr in GRANULARITIES)
    assert tensor > 0.3 and row < tensor / 2 and block < 0.12, (tensor, row, block)


def test_delayed_scaling_saturates_a_spike_the_history_has_not_seen():
    h = AmaxHistory(2)
    assert float(h.amax(torch.tensor(1.0))) == 1.0                      # first step: its own amax
    assert float(h.amax(torch.tensor(5.0))) == 1.0                      # the spike is scaled by the old amax
    assert float(h.amax(torch.tensor(1.0))) == 5.0
    layer = FP8Linear(16, 8, recipe=FP8Recipe("tensor", "delayed", history=4))
    layer(torch.randn(4, 16))
    layer(torch.randn(4, 16) * 100)
    assert layer.saturated > 0
    current = FP8Linear(16, 8, recipe=FP8Recipe("tensor"))
    current(torch.randn(4, 16))
    current(torch.randn(4, 16) * 100)
    assert current.saturated == 0


def test_recipe_validation():
    with pytest.raises(ValueError, match="granularity"):
        FP8Recipe("column")
    with pytest.raises(ValueError, match="tensor"):
        FP8Recipe("block", "delayed")
    with pytest.raises(ValueError, match="scaling"):
        FP8Recipe("tensor", "lazy")
    with pytest.raises(ValueError, match="E4M3 or E5M2"):
        FP8Recipe(grad_format="FP16")


@pytest.mark.parametrize("recipe", [FP8Recipe("tensor"), FP8Recipe("row"), FP8Recipe("block", block=32),
                                    FP8Recipe("block", block=32, grad_format=E4M3),
                                    FP8Recipe("tensor", "delayed")])
def test_fp8_linear_gradients_are_fp32s_to_fp8_precision(recipe):
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 48)
    layer = to_fp8(torch.nn.Sequential(torch.nn.Linear(64, 48)), recipe)[0]
    layer.load_state_dict(ref.state_dict())
    assert isinstance(layer, FP8Linear)
    x = torch.randn(2, 16, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(x1), layer(x2)
    gy = torch.randn_like(y_ref)
    y_ref.backward(gy)
    y.backward(gy)
    rel = lambda a, b: float((a - b).detach().norm() / b.detach().norm())  # noqa: E731
    bound = 0.05 if recipe.grad_format is E4M3 else 0.1                 # E5M2 has half E4M3's precision
    assert rel(y, y_ref) < 0.05
    assert rel(x2.grad, x1.grad) < bound and rel(layer.weight.grad, ref.weight.grad) < bound
    assert rel(layer.bias.grad, ref.bias.grad) < 1e-6                    # the bias is not quantized


def test_to_fp8_keeps_the_parameters():
    from minipar.models import TinyGPT
    model = TinyGPT()
    before = dict(model.named_parameters())
    to_fp8(model)
    after = dict(model.named_parameters())
    assert list(before) == list(after) and all(before[n] is after[n] for n in before)
    assert sum(isinstance(m, FP8Linear) for m in model.modules()) == 4 * 2 + 1


def test_round_mantissa():
    x = torch.tensor([1.0, 1.0 + 2 ** -4, 1.0 + 3 * 2 ** -4, 1.0 + 2 ** -5, 3.0], dtype=torch.float64)
    assert round_mantissa(x, 3).tolist() == [1.0, 1.0, 1.25, 1.0, 3.0]   # ties to even
    assert torch.equal(round_mantissa(x, 52), x)


def test_accumulation_error_grows_with_k_and_promotion_stops_it():
    """DeepSeek-V3 §3.3.2: ~14 significant bits (13 fraction bits) in the tensor cores; promotion every 128."""
    k_small, k_large = 128, 2048
    without = [accumulation_error(k, 13, None, n=64, positive=True) for k in (k_small, k_large)]
    promoted = accumulation_error(k_large, 13, 128, n=64, positive=True)
    assert without[1] > 3 * without[0], without
    assert promoted < without[0] and promoted < without[1] / 10, (promoted, without)
    assert accumulation_error(k_large, 23, None, n=64, positive=True) < 1e-6      # FP32-like accumulator
    products = torch.ones(1, 300, dtype=torch.float64)
    assert float(accumulate(products, 52)) == 300.0
    assert float(accumulate(products, 4)) == 32.0                          # 1 + 32 rounds back to 32 at 5 bits
    assert float(accumulate(products, 4, promote_every=16)) == 300.0


def _qdq(t, block, dtype):
    """Quantize-dequantize written plainly, one block at a time, in float64 (the scale rounded to FP32 as
    the library stores it): s = amax / max, fp8(x / s) · s."""
    fmt_max = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[dtype]
    t, out = t.double(), torch.empty(t.shape, dtype=torch.float64)
    for i in range(0, t.shape[0], block[0]):
        for j in range(0, t.shape[1], block[1]):
            b = t[i:i + block[0], j:j + block[1]]
            s = (b.abs().max() / fmt_max).float().double() if b.abs().max() > 0 else torch.tensor(1.0).double()
            out[i:i + block[0], j:j + block[1]] = (b / s).float().clamp(-fmt_max, fmt_max).to(dtype).double() * s
    return out


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_linear_equals_a_plain_quantize_dequantize_reference(granularity):
    """The forward and both backward GEMMs against y = Q(x) Q(W)ᵀ, dX = Q(G) Q(W), dW = Q(Gᵀ) Q(Xᵀ)ᵀ with Q
    the plain block loop above, in float64: equal to FP32 rounding (the library multiplies in FP32)."""
    (m, k, n), e4, e5 = (96, 300, 200), torch.float8_e4m3fn, torch.float8_e5m2
    x, w, gy = _x(4, (m, k)), _x(5, (n, k)) * 0.05, _x(6, (m, n)) * 1e-3
    tile = lambda shape: {"tensor": shape, "row": (1, shape[1]), "block": (1, 128)}[granularity]  # noqa: E731
    square = {"tensor": (n, k), "row": (1, k), "block": (128, 128)}[granularity]
    wq = _qdq(w, square, e4)
    want = (_qdq(x, tile((m, k)), e4) @ wq.t(), _qdq(gy, tile((m, n)), e5) @ wq,
            _qdq(gy.t(), tile((n, m)), e5) @ _qdq(x.t(), tile((k, m)), e4).t())
    layer = FP8Linear(k, n, bias=False, recipe=FP8Recipe(granularity))
    layer.weight.data.copy_(w)
    xi = x.clone().requires_grad_()
    y = layer(xi)
    y.backward(gy)
    for got, ref in zip((y.detach(), xi.grad, layer.weight.grad), want):
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-6


def test_one_by_one_blocks_make_quantization_the_identity():
    """Every value its own block: it lands on ±max exactly, so FP8Linear is nn.Linear to FP32 rounding — the
    whole emulated path (scales, casts, transposed weight blocks) with the quantization error taken out."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 48)
    layer = to_fp8(torch.nn.Sequential(torch.nn.Linear(64, 48)), FP8Recipe("block", block=1))[0]
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(16, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    gy = torch.randn(16, 48)
    ref(x1).backward(gy)
    layer(x2).backward(gy)
    assert torch.allclose(x2.grad, x1.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(layer.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-6)

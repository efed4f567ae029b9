"""Chapter 10b checks accept the right answers and reject plausible wrong ones: a scale that is the amax
itself, its inverse, the max instead of the max of |x|, blocks without the partial edge; errors measured
over every channel, or with the activations scaled per tensor."""
import pytest
import torch

from minipar.course.checks import ExerciseError
from minipar.course.ch10b_fp8 import checks as ch10b
from minipar.precision.formats import E4M3
from minipar.precision.fp8 import block_of, fp8_matmul, quantize


def tensor_scale(x):
    return float(x.abs().max()) / 448


def block_scales(x, rows, cols, edge=True):
    m, k = x.shape
    nr, nc = (-(-m // rows), -(-k // cols)) if edge else (m // rows, k // cols)
    return torch.tensor([[float(x[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].abs().max()) / 448
                          for j in range(nc)] for i in range(nr)])


def stub(*a):
    raise NotImplementedError()


WRONG_SCALES = {"amax": (lambda x: float(x.abs().max()), "448"),
                "inverse": (lambda x: 448 / float(x.abs().max()), "1/s"),
                "no abs": (lambda x: float(x.max()) / 448, "absolute")}


def test_scales_right_pass():
    ch10b.check_scales(tensor_scale, block_scales)


@pytest.mark.parametrize("wrong", list(WRONG_SCALES))
def test_wrong_tensor_scales_rejected(wrong):
    fn, message = WRONG_SCALES[wrong]
    x = ch10b._activations()
    assert fn(x) != tensor_scale(x)                      # the wrong answer really differs here
    with pytest.raises(ExerciseError, match=message):
        ch10b.check_scales(fn, block_scales)


def test_blocks_without_the_edge_rejected():
    with pytest.raises(ExerciseError, match="partial"):
        ch10b.check_scales(tensor_scale, lambda x, r, c: block_scales(x, r, c, edge=False))


def test_scales_stub_not_implemented():
    with pytest.raises(NotImplementedError):
        ch10b.check_scales(stub, stub)


def errors(x, w, keep, everything=False, acts_per_tensor=False):
    out = {}
    for g in ("tensor", "row", "block"):
        xq = quantize(x, E4M3, None if acts_per_tensor else block_of(g, x.shape, (1, 128)))
        wq = quantize(w, E4M3, block_of(g, w.shape, (128, 128)))
        k = torch.ones_like(keep) if everything else keep
        exact = x[:, k].double() @ w[:, k].double().t()
        got = xq.dequantize()[:, k].double() @ wq.dequantize()[:, k].double().t()
        out[g] = float((got - exact).abs().mean() / exact.abs().mean())
    return out


def test_small_channel_errors_right_pass():
    ch10b.check_small_channel_errors(errors)
    x, w, keep = ch10b.outlier_case()
    e = errors(x, w, keep)
    assert min(e, key=e.get) == "block" and e["tensor"] > 3 * e["block"]
    assert fp8_matmul(quantize(x), quantize(w)).shape == (256, 256)


def test_small_channel_errors_wrong_rejected():
    with pytest.raises(ExerciseError, match="kept channels"):
        ch10b.check_small_channel_errors(lambda x, w, k: errors(x, w, k, everything=True))
    with pytest.raises(ExerciseError, match="blocks"):
        ch10b.check_small_channel_errors(lambda x, w, k: errors(x, w, k, acts_per_tensor=True))
    with pytest.raises(NotImplementedError):
        ch10b.check_small_channel_errors(stub)

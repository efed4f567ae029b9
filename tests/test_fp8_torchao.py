"""Our tensor-wise FP8 recipe (current scaling, E4M3 forward, E5M2 gradients) against torchao's
``Float8Linear`` with ``emulate=True`` — the same recipe, its default — where torchao is installed (a course
dependency, ``pip install -e .[course]``; the library does not need it): one layer's output and gradients, and
one backward of the tiny GPT, agree far more closely than either agrees with FP32; and our MXFP8 quantizer
equals torchao's ``to_mx`` bit for bit."""
import logging

import pytest
import torch

torchao_float8 = pytest.importorskip("torchao.float8")

from minipar.precision.fp8 import FP8Recipe, to_fp8  # noqa: E402

logging.getLogger("torchao").setLevel(logging.ERROR)


def _torchao(model):
    config = torchao_float8.Float8LinearConfig(emulate=True)
    torchao_float8.convert_to_float8_training(model, config=config)
    return model


def _rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def test_one_layer_agrees_with_torchao():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(128, 64))
    ours, theirs = (torch.nn.Sequential(torch.nn.Linear(128, 64)) for _ in range(2))
    ours.load_state_dict(ref.state_dict())
    theirs.load_state_dict(ref.state_dict())
    to_fp8(ours, FP8Recipe("tensor"))
    _torchao(theirs)
    x = torch.randn(32, 128)
    gy = torch.randn(32, 64)
    outs = []
    for model in (ref, ours, theirs):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(gy)
        outs.append((y, xi.grad, model[0].weight.grad))
    for (r, o, t) in zip(*outs):
        assert _rel(o, t) < _rel(o, r) / 5, (_rel(o, t), _rel(o, r))


def test_tiny_gpt_gradients_agree_with_torchao():
    """One backward of the 128-wide tiny GPT: our FP8 gradients are closer to torchao's than to FP32's.
    (Trajectories over many Adam steps are not compared: Adam turns tiny differences on near-zero gradients
    into full-size updates, and both FP8 runs drift from each other as from BF16.)"""
    from minipar.course.ch10b_fp8.tour import recipe
    from minipar.loop import lm_loss
    r = recipe()
    x, y = r.batches[0]
    grads = []
    for model in (r.model(), to_fp8(r.model(), FP8Recipe("tensor")), _torchao(r.model())):
        lm_loss(model(x), y).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    fp32, ours, theirs = grads
    assert _rel(ours, theirs) < _rel(ours, fp32) / 3, (_rel(ours, theirs), _rel(ours, fp32))


def test_mxfp8_equals_torchao_to_mx():
    """torchao's ``to_mx`` (OCP MX v1.0, floor rule, 1×32) and ours: the same E4M3 elements and E8M0 scales."""
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from minipar.precision.mxfp8 import e8m0_codes, quantize_mx
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 8).repeat_interleave(32)
    scale, data = to_mx(x, torch.float8_e4m3fn, 32)
    ours = quantize_mx(x)
    assert torch.equal(data.view(torch.uint8), ours.data.view(torch.uint8))
    assert torch.equal(scale.view(torch.uint8).reshape(ours.scale.shape), e8m0_codes(ours))

"""Our tensor-wise FP8 recipe (current scaling, E4M3 forward, E5M2 gradients) against torchao's
``Float8Linear`` with ``emulate=True`` — the same recipe, its default — where torchao is installed (an optional
course extra, ``pip install -e .[fp8]``; the library does not need it): one layer's output and gradients agree
far more closely than either agrees with FP32, and the tiny GPT's losses over 20 BF16 steps stay together."""
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

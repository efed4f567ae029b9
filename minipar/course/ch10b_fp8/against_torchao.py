"""Chapter 10b: minipar's FP8 against torchao's (a dependency of the course, not of the library).

Two comparisons, both on CPU:

* tensor-wise: torchao's ``Float8Linear`` with ``emulate=True`` (its default recipe is our tensor-wise one:
  current scaling, E4M3 forward, E5M2 gradients) — one forward and backward of the 128-wide tiny GPT, the
  gradients of ours against torchao's and both against FP32;
* MXFP8: torchao's ``to_mx`` (OCP MX v1.0, floor rule, 1×32 blocks) against :func:`minipar.precision.mxfp8.
  quantize_mx` on the activation matrix with outlier channels of §2: elements and E8M0 scales compared bit
  for bit.

torchao is imported here, when the comparison runs (it takes a few seconds); its warnings about the GPU
kernels it cannot load on a CPU machine are silenced first.
"""
from __future__ import annotations

import logging

import torch

from minipar.course.report import Report
from minipar.loop import lm_loss
from minipar.precision.fp8 import FP8Recipe, to_fp8
from minipar.precision.mxfp8 import e8m0_codes, quantize_mx

from . import training

__all__ = ["compare_with_torchao"]


def _import_torchao():
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError as e:
        raise ImportError("chapter 10b compares with torchao, a course dependency: pip install -e '.[course]'") from e
    return Float8LinearConfig, convert_to_float8_training, to_mx


def _check(r: Report) -> None:
    assert r.ours_vs_torchao < r.ours_vs_fp32 / 3, (r.ours_vs_torchao, r.ours_vs_fp32)
    assert r.mx_elements_equal and r.mx_scales_equal


def compare_with_torchao(activations: torch.Tensor) -> Report:
    """The two comparisons above; ``activations``: the matrix of §2 (its width a multiple of 32)."""
    Float8LinearConfig, convert_to_float8_training, to_mx = _import_torchao()
    r = training.seed_recipe(0)
    xb, yb = r.batches[0]
    models = {"FP32": r.model(), "ours": to_fp8(r.model(), FP8Recipe("tensor")),
              "torchao": convert_to_float8_training(r.model(), config=Float8LinearConfig(emulate=True))}
    grads = {}
    with training.one_thread():
        for name, model in models.items():
            lm_loss(model(xb), yb).backward()
            grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
        rel = lambda a, b: float((grads[a] - grads[b]).norm() / grads[b].norm())   # noqa: E731
        scale, data = to_mx(activations.contiguous(), torch.float8_e4m3fn, 32)
        ours = quantize_mx(activations)
    elements_equal = torch.equal(data.view(torch.uint8), ours.data.view(torch.uint8))
    scales_equal = torch.equal(scale.view(torch.uint8).reshape(ours.scale.shape), e8m0_codes(ours))
    text = (f"one backward of the tiny GPT, relative difference of all gradients: ours vs torchao "
            f"{rel('ours', 'torchao'):.3%}, ours vs FP32 {rel('ours', 'FP32'):.2%}, torchao vs FP32 "
            f"{rel('torchao', 'FP32'):.2%}"
            + (" (identical: the two round every value the same way)" if rel("ours", "torchao") == 0 else
               f" (ours and torchao's {rel('ours', 'FP32') / rel('ours', 'torchao'):.0f}× closer to each other "
               "than to FP32)") + "\n"
            f"MXFP8 of the {tuple(activations.shape)} activation matrix, torchao's to_mx against ours: elements "
            f"{'identical' if elements_equal else 'DIFFERENT'}, E8M0 scales "
            f"{'identical' if scales_equal else 'DIFFERENT'} ({ours.scale.numel()} blocks)")
    return Report(text, _check, ours_vs_torchao=rel("ours", "torchao"), ours_vs_fp32=rel("ours", "FP32"),
                  torchao_vs_fp32=rel("torchao", "FP32"), mx_elements_equal=elements_equal,
                  mx_scales_equal=scales_equal)

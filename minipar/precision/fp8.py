"""FP8 matrix multiplies with scales: tensor-wise, row-wise and block-wise; current or delayed scaling.

FP8 has too little range to hold a tensor as it is (E4M3's max is 448, FP16's 65504, FP32's 3.4e38), so
every FP8 tensor travels with a higher-precision **scale** s per block of values:

    s = amax(block) / max_fmt,      q = fp8(x / s)   (saturated to ±max_fmt),      x ≈ s · q

so that the largest |x| of each block lands on the format's largest value. The GEMM multiplies the q's and
multiplies the FP32 result by s_a · s_b. The granularity of the blocks decides what survives an outlier:

* ``tensor``: one s per tensor — one large channel pushes every small value into the subnormals or to 0;
* ``row``: one s per row (per token for activations, per output channel for weights);
* ``block``: DeepSeek-V3 (2024, §3.3): 1×128 tiles of activations and gradients, 128×128 blocks of weights.

Scaling is **current** (amax of this tensor now, "just in time") or **delayed** (Transformer Engine, Micikevicius
et al. 2022: s from the largest amax of the last ``history`` steps, so the amax needs no extra pass over the
data; a value larger than the history has seen is saturated). Forward operands are E4M3 (more precision);
gradients are E5M2 by default — their range is wider and less predictable, E5M2 has FP16's exponent range —
or E4M3 when the scales are fine-grained enough to bring the range in (DeepSeek-V3 uses E4M3 everywhere).

Tensor- and row-wise GEMMs run on ``torch._scaled_mm`` (CPU); it refuses block scales, so block-wise is
emulated: every element dequantized (s · q, one FP32 rounding) and multiplied in FP32, which an FP8 tensor
core reproduces up to FP32 rounding (it applies s_a · s_b per 128-long chunk of the sum).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.nn as nn

from .formats import E4M3, E5M2, FloatFormat, format_of

__all__ = ["GRANULARITIES", "SCALINGS", "Quantized", "block_amax", "quantize", "fp8_matmul", "gemm_error",
           "AmaxHistory", "FP8Recipe", "FP8Linear", "to_fp8"]

GRANULARITIES = ("tensor", "row", "block")
SCALINGS = ("current", "delayed")


@dataclass
class Quantized:
    """An FP8 tensor ``data`` with one FP32 ``scale`` per ``block`` (rows, columns) of it: x ≈ scale · data."""
    data: torch.Tensor
    scale: torch.Tensor          # shape (ceil(M / block[0]), ceil(K / block[1]))
    block: tuple

    def expanded_scale(self) -> torch.Tensor:
        m, k = self.data.shape
        return self.scale.repeat_interleave(self.block[0], 0).repeat_interleave(self.block[1], 1)[:m, :k]

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * self.expanded_scale()

    @property
    def saturated(self) -> int:
        """How many values sit on ±max of the format (clipped there, or exactly the block's amax)."""
        return int((self.data.float().abs() == format_of(self.data.dtype).max).sum())


def block_of(granularity: str, shape, block: tuple) -> tuple:
    """The (rows, columns) of one scale's block: the whole tensor, one row, or ``block``."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    return {"tensor": tuple(shape), "row": (1, shape[1]), "block": tuple(block)}[granularity]


def block_amax(x: torch.Tensor, block: tuple) -> torch.Tensor:
    """max |x| over each (block[0] × block[1]) block of the 2-D ``x`` (the edges padded with zeros)."""
    (m, k), (br, bc) = x.shape, block
    padded = x.detach().float().abs()
    if m % br or k % bc:                                  # a partial block at an edge: pad it with zeros
        padded = torch.zeros((-(-m // br)) * br, (-(-k // bc)) * bc, dtype=torch.float32)
        padded[:m, :k] = x.detach().float().abs()
    return padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc).amax(dim=(1, 3))


def quantize(x: torch.Tensor, fmt=E4M3, block: tuple | None = None, amax: torch.Tensor | None = None) -> Quantized:
    """FP8 ``x`` with scale s = amax / max_fmt per ``block`` (default: the whole tensor). ``amax``: use these
    (e.g. from a history) instead of the tensor's own; values beyond them are saturated to ±max_fmt."""
    fmt = format_of(fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {tuple(x.shape)}")
    block = tuple(x.shape) if block is None else tuple(block)
    amax = block_amax(x, block) if amax is None else amax.float().reshape(block_amax(x, block).shape)
    scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    q = Quantized(x, scale, block)
    data = (x.detach().float() / q.expanded_scale()).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return Quantized(data, scale, block)


def fp8_matmul(a: Quantized, b: Quantized) -> torch.Tensor:
    """a @ bᵀ in FP32 (b is stored like ``nn.Linear.weight``: out × in). Tensor- and row-wise scales on
    ``torch._scaled_mm``; anything else emulated (dequantize, FP32 matmul)."""
    (m, k), (n, _) = a.data.shape, b.data.shape
    a_kind = "tensor" if a.scale.numel() == 1 else "row" if a.block == (1, k) else "block"
    b_kind = "tensor" if b.scale.numel() == 1 else "row" if b.block == (1, k) else "block"
    if a_kind != "block" and b_kind != "block" and a_kind == b_kind:
        sa = a.scale.reshape(()) if a_kind == "tensor" else a.scale.reshape(m, 1)
        sb = b.scale.reshape(()) if b_kind == "tensor" else b.scale.reshape(1, n)
        return torch._scaled_mm(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    return a.dequantize() @ b.dequantize().t()


def gemm_error(x: torch.Tensor, w: torch.Tensor, granularity: str, block: int = 128, keep=None) -> float:
    """Relative error of the FP8 (E4M3) product x @ wᵀ against FP64: mean |y_fp8 - y_64| / mean |y_64|.
    Blocks: 1×``block`` for x, ``block``×``block`` for w. ``keep`` (a boolean mask over the inner dimension):
    quantize everything, but measure only what those channels contribute (the small ones, beside outliers)."""
    xq = quantize(x, E4M3, block_of(granularity, x.shape, (1, block)))
    wq = quantize(w, E4M3, block_of(granularity, w.shape, (block, block)))
    keep = torch.ones(x.shape[1], dtype=torch.bool) if keep is None else keep
    exact = x[:, keep].double() @ w[:, keep].double().t()
    got = xq.dequantize()[:, keep].double() @ wq.dequantize()[:, keep].double().t()
    return float((got - exact).abs().mean() / exact.abs().mean())


class AmaxHistory:
    """The amax of the last ``length`` steps; delayed scaling uses their maximum (Transformer Engine)."""

    def __init__(self, length: int):
        self.values = deque(maxlen=length)

    def amax(self, current: torch.Tensor) -> torch.Tensor:
        """The amax to scale with now: the history's maximum (the current one at the first step), then
        record the current one for the next steps."""
        use = current if not self.values else torch.stack(list(self.values)).amax(0)
        self.values.append(current)
        return use


@dataclass(frozen=True)
class FP8Recipe:
    """How an :class:`FP8Linear` quantizes: ``granularity`` tensor | row | block (``block`` long tiles),
    ``scaling`` current | delayed (``history`` steps; tensor-wise only), ``grad_format`` E5M2 or E4M3."""
    granularity: str = "block"
    scaling: str = "current"
    history: int = 16
    grad_format: FloatFormat = E5M2
    block: int = 128

    def __post_init__(self):
        block_of(self.granularity, (1, 1), (1, 1))
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.scaling == "delayed" and self.granularity != "tensor":
            raise ValueError("delayed scaling keeps one amax history per tensor: use granularity='tensor'")
        if self.history < 1 or self.block < 1:
            raise ValueError(f"history and block must be positive, got {self.history}, {self.block}")
        if format_of(self.grad_format) not in (E4M3, E5M2):
            raise ValueError(f"grad_format must be E4M3 or E5M2, got {self.grad_format}")

    @property
    def name(self) -> str:
        delayed = f", delayed h={self.history}" if self.scaling == "delayed" else ""
        return f"FP8 {self.granularity}-wise{delayed} (grads {format_of(self.grad_format).name})"


class _FP8LinearFunction(torch.autograd.Function):
    """y = x Wᵀ with both operands in E4M3; dX = G W and dW = Gᵀ X with G in the recipe's gradient format.
    Activations and gradients are tiled along the contraction dimension of each GEMM (so dW re-quantizes
    Gᵀ and Xᵀ along the tokens), weights in square blocks, which serve W and Wᵀ alike."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        xq, wq = layer.quantize("x", x, E4M3, (1, layer.block)), layer.quantize("w", weight, E4M3, None)
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.wq = layer, wq
        return fp8_matmul(xq, wq).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        layer, fmt, tile = ctx.layer, ctx.layer.recipe.grad_format, (1, ctx.layer.block)
        gq = layer.quantize("grad", grad, fmt, tile)
        wtq = Quantized(ctx.wq.data.t(), ctx.wq.scale.t(), ctx.wq.block[::-1])      # Wᵀ: same blocks, turned
        dx = fp8_matmul(gq, wtq) if layer.recipe.granularity != "row" else gq.dequantize() @ ctx.wq.dequantize()
        dw = fp8_matmul(layer.quantize("grad_t", grad.t(), fmt, tile), layer.quantize("x_t", x.t(), E4M3, tile))
        return dx.to(x.dtype), dw.to(weight.dtype), None


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 under ``recipe`` (the bias is added in the input's precision).
    ``saturated`` counts the values clipped at ±max so far (the symptom of a too-short amax history)."""

    def __init__(self, in_features, out_features, bias=True, recipe: FP8Recipe = FP8Recipe(), **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.recipe, self.block = recipe, recipe.block
        self.histories, self.saturated = {}, 0

    def quantize(self, role: str, t: torch.Tensor, fmt, tile) -> Quantized:
        block = block_of(self.recipe.granularity, t.shape, tile or (self.block, self.block))
        amax = None
        if self.recipe.scaling == "delayed":
            history = self.histories.setdefault(role, AmaxHistory(self.recipe.history))
            amax = history.amax(block_amax(t, block))
        q = quantize(t, fmt, block, amax)
        if amax is not None:
            self.saturated += int((t.detach().float().abs() > amax.max() * (1 + 1e-6)).sum())
        return q

    def forward(self, x):
        y = _FP8LinearFunction.apply(x.reshape(-1, x.shape[-1]), self.weight, self)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def to_fp8(model: nn.Module, recipe: FP8Recipe = FP8Recipe()) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`FP8Linear` holding the same parameters (same
    names, same objects); returns ``model``."""
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear:
            new = FP8Linear(child.in_features, child.out_features, child.bias is not None, recipe,
                            device="meta")
            new.weight, new.bias = child.weight, child.bias
            setattr(model, name, new)
        else:
            to_fp8(child, recipe)
    return model

"""Checks for chapter 10b's exercises: compute FP8 scales, and find the recipe that survives an outlier.

* :func:`check_scales` compares the learner's ``tensor_scale(x)`` and ``block_scales(x, rows, cols)`` with
  :func:`minipar.precision.fp8.quantize`'s scales (s = amax / 448 per block, edge blocks included) and
  checks that dequantizing with them puts every normal value within half an E4M3 ulp.
* :func:`check_small_channel_errors` compares the learner's ``small_channel_errors(x, w, keep)`` with
  :func:`minipar.precision.fp8.gemm_error` on activations with outlier channels, and names the survivor.
"""
from __future__ import annotations

import torch

from minipar.course.checks import fail
from minipar.precision.formats import E4M3
from minipar.precision.fp8 import GRANULARITIES, block_of, gemm_error, quantize

__all__ = ["check_scales", "check_small_channel_errors", "outlier_case"]


def _activations(seed: int = 0, shape=(6, 300)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[:, 7] *= 300.0                                    # one outlier channel
    x[0, 7] = -1000.0                                   # its largest value negative
    return x


def check_scales(tensor_scale, block_scales) -> None:
    """``tensor_scale(x)`` -> a float; ``block_scales(x, rows, cols)`` -> (ceil(M/rows), ceil(K/cols))."""
    x = _activations()
    want = float(quantize(x, E4M3).scale)
    got = tensor_scale(x)
    if got is None or abs(float(got) - want) > 1e-6 * want:
        amax = float(x.abs().max())
        mistake = ("divide the amax by E4M3's max, 448: s = amax / 448 puts the largest value on 448"
                   if got is not None and abs(float(got) - amax) < 1e-3 * amax else
                   "that is 1/s: the scale multiplies the FP8 value back (x ≈ s·q), so s = amax / 448"
                   if got is not None and abs(float(got) * want - 1) < 1e-3 else
                   "use the largest absolute value, max |x| (a negative outlier counts)"
                   if got is not None and abs(float(got) - float(x.max()) / 448) < 1e-6 else
                   "s = max |x| / 448")
        fail("tensor_scale(x)", want, got, mistake)
    for rows, cols in ((1, 128), (2, 128), (6, 300), (4, 64)):
        want_b = quantize(x, E4M3, (rows, cols)).scale
        got_b = block_scales(x, rows, cols)
        what = f"block_scales(x of shape {tuple(x.shape)}, {rows}, {cols})"
        if not isinstance(got_b, torch.Tensor) or got_b.shape != want_b.shape:
            fail(what + " shape", tuple(want_b.shape), getattr(got_b, "shape", got_b),
                 "one scale per block, the last, partial block included: ceil(M / rows) × ceil(K / cols)")
        if not torch.allclose(got_b.float(), want_b, rtol=1e-6, atol=0):
            fail(what, want_b, got_b, "each block's own max |x| divided by 448")
    tiles = quantize(x, E4M3, (1, 128)).scale
    print(f"scales: tensor-wise {want:.4g} = amax {float(x.abs().max()):.4g} / 448, and every block's own; "
          f"with a 300x channel, a 1x128 tile without it gets a scale "
          f"{float(tiles.max() / tiles.min()):.0f}x finer")


def outlier_case(magnitude: float = 1e5, seed: int = 0) -> tuple:
    """(x, w, keep): 256×512 activations whose channels 3, 100, 300 are ``magnitude`` times larger, weights,
    and the mask of the small channels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 512, generator=g) * 0.05
    x = torch.randn(256, 512, generator=g)
    keep = torch.ones(512, dtype=torch.bool)
    keep[[3, 100, 300]] = False
    x[:, ~keep] *= magnitude
    return x, w, keep


def check_small_channel_errors(small_channel_errors) -> None:
    """``small_channel_errors(x, w, keep)`` -> {"tensor": e, "row": e, "block": e}: the relative error, against
    FP64, of what the kept channels contribute to x @ wᵀ when everything was quantized to E4M3."""
    x, w, keep = outlier_case()
    want = {g: gemm_error(x, w, g, keep=keep) for g in GRANULARITIES}
    got = small_channel_errors(x, w, keep)
    if not isinstance(got, dict) or set(got) != set(GRANULARITIES):
        fail("small_channel_errors(...)", {g: round(e, 4) for g, e in want.items()}, got,
             "return a dict with the keys 'tensor', 'row' and 'block'")
    every = {g: gemm_error(x, w, g) for g in GRANULARITIES}
    for g in GRANULARITIES:
        if abs(float(got[g]) - want[g]) > 1e-3 * want[g]:
            mistake = ("measure only what the kept channels contribute (x[:, keep] and w[:, keep]): over every "
                       "channel the outliers' own contribution hides the small ones' error"
                       if abs(float(got[g]) - every[g]) < 1e-3 * every[g] else
                       f"quantize x in blocks {block_of(g, x.shape, (1, 128))} and w in blocks "
                       f"{block_of(g, w.shape, (128, 128))}, then compare the kept channels' product with FP64")
            fail(f"the {g}-wise error", want[g], got[g], mistake)
    survivor = min(want, key=want.get)
    print(f"small channels beside 1e5x outliers: tensor-wise {want['tensor']:.1%}, row-wise {want['row']:.1%}, "
          f"block-wise {want['block']:.1%} — {survivor}-wise survives")

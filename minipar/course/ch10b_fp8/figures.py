"""Chapter 10b pictures and tables, from :mod:`minipar.precision`: the scales of the granularities (tensor,
row, DeepSeek-V3's 1×128 tiles, MXFP8's 1×32 power-of-two blocks) over a real activation matrix of the tiny
GPT given outlier channels, the error sweep against the outliers' size, the accumulation error against K with
and without promotion, and the training study of §5 (:mod:`.training`)."""
from __future__ import annotations

import torch

from minipar.course.plotting import save_figure
from minipar.course.report import Report
from minipar.precision.accumulation import accumulation_error
from minipar.precision.formats import E4M3
from minipar.precision.fp8 import GRANULARITIES, block_of, gemm_error, quantize
from minipar.precision.mxfp8 import mx_gemm_error, quantize_mx

from . import training
from .training import one_thread
from .checks import outlier_case

__all__ = ["one_thread", "OUTLIER_CHANNELS", "OUTLIER_SIZE", "activation_matrix", "with_outliers", "SCHEMES",
           "quantize_scheme", "draw_granularities", "outlier_sweep", "accumulation_table", "draw_accumulation",
           "draw_training_study", "FIGURES"]

OUTLIER_CHANNELS = (3, 100, 300)
OUTLIER_SIZE = 1e4          # "massive activations" (Sun et al. 2024): up to ~10^4 times the median
SCHEMES = ("tensor", "row", "block", "mx")
TITLES = {"tensor": "tensor-wise", "row": "row-wise (per token)", "block": "1×128 tiles (DeepSeek-V3)",
          "mx": "MXFP8: 1×32, 2^k scales"}


def activation_matrix() -> torch.Tensor:
    """The input of the first block's MLP down-projection (GeLU output, tokens × 512) of the 128-wide tiny
    GPT of the tour, on its first batch: a real activation matrix, recorded by a forward hook."""
    r = training.seed_recipe(0)
    model, seen = r.model(), []
    model.blocks[0].mlp.proj.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach()))
    with torch.no_grad(), one_thread():
        model(r.batches[0][0])
    return seen[0].reshape(-1, seen[0].shape[-1])


def with_outliers(x: torch.Tensor, size: float = OUTLIER_SIZE, channels=OUTLIER_CHANNELS) -> tuple:
    """(x with ``channels`` multiplied by ``size`` / their own median |x| × the matrix's median |x| — outlier
    channels ``size`` times the typical value, as large language models have and this tiny one does not —,
    the boolean mask of the other channels)."""
    x, keep = x.clone(), torch.ones(x.shape[1], dtype=torch.bool)
    keep[list(channels)] = False
    typical = x.abs().median()
    x[:, ~keep] *= size * typical / x[:, ~keep].abs().median()
    return x, keep


def quantize_scheme(x: torch.Tensor, scheme: str):
    """``x`` (tokens × channels) quantized to E4M3 under ``scheme``: tensor, row, block (1×128), mx (1×32)."""
    if scheme == "mx":
        return quantize_mx(x, E4M3)
    return quantize(x, E4M3, block_of(scheme, x.shape, (1, 128)))


def draw_granularities(axes, x: torch.Tensor, keep: torch.Tensor) -> dict:
    """|x| and, per scheme, log2 of the scale each element is quantized with, titled with what was measured:
    the relative error of the small (kept) channels, mean |x̂ − x| / mean |x| over them, and the fraction of
    their values that land in E4M3's subnormals or at 0. Returns {scheme: (error, fraction flushed)}."""
    kw = dict(aspect="auto", interpolation="nearest", cmap="viridis")
    axes[0].imshow(torch.log2(x.abs() + 1e-12).numpy(), **kw)
    axes[0].set_title(f"log2 |x|  (tokens × channels)\n{int((~keep).sum())} outlier channels")
    measured = {}
    for ax, scheme in zip(axes[1:], SCHEMES):
        q = quantize_scheme(x, scheme)
        ax.imshow(torch.log2(q.expanded_scale()).numpy(), **kw)
        small, err = x[:, keep], (q.dequantize() - x)[:, keep]
        flushed = (q.data.float().abs()[:, keep] < E4M3.smallest_normal) & (small != 0)
        measured[scheme] = (float(err.abs().mean() / small.abs().mean()), float(flushed.float().mean()))
        ax.set_title(f"{TITLES[scheme]}: log2 scale\nsmall channels: error {measured[scheme][0]:.2%}, "
                     f"{measured[scheme][1]:.1%} subnormal/0", fontsize=9)
    for ax in axes:
        ax.set_xlabel("channel")
    axes[0].set_ylabel("token")
    return measured


def _check_sweep(r: Report) -> None:
    """The chapter's sentences: all at FP8's floor without outliers; tensor-wise loses the small channels at
    1e5×; row-wise helps little; the 1×128 tiles and MX blocks keep them, MX at least as well; MX a little above
    the floor without outliers."""
    e = r.errors
    assert all(v < 0.05 for v in e[1].values()) and e[1]["mx"] > e[1]["block"]
    assert e[1e5]["tensor"] > 0.3 and e[1e5]["row"] < e[1e5]["tensor"] / 2 and e[1e5]["row"] > 0.12
    assert e[1e5]["block"] < 0.12 and e[1e5]["mx"] <= e[1e5]["block"]


def outlier_sweep(magnitudes=(1, 1e2, 1e3, 1e4, 1e5)) -> Report:
    """The relative error, against FP64, of the small channels' contribution to x·Wᵀ (``gemm_error`` and, for
    MXFP8, ``mx_gemm_error``) when channels 3, 100 and 300 are ``magnitude`` times larger."""
    errors = {}
    with one_thread():
        for magnitude in magnitudes:
            x, w, keep = outlier_case(magnitude)
            errors[magnitude] = {g: gemm_error(x, w, g, keep=keep) for g in GRANULARITIES}
            errors[magnitude]["mx"] = mx_gemm_error(x, w, keep)
    lines = [f"{'outlier ×':>10}" + "".join(f"{TITLES[s].split(' (')[0].split(':')[0]:>15}" for s in SCHEMES)]
    lines += [f"{m:>10g}" + "".join(f"{errors[m][s]:>15.2%}" for s in SCHEMES) for m in magnitudes]
    return Report("\n".join(lines), _check_sweep, errors=errors)


def accumulation_table(ks=(128, 512, 1024, 2048, 4096), bits: int = 13, n: int = 128) -> dict:
    """{K: (error without promotion, error with promotion every 128)} for ``bits``-bit accumulation of
    positive FP8 products (:func:`minipar.precision.accumulation.accumulation_error`)."""
    with one_thread():
        return {k: (accumulation_error(k, bits, None, n, positive=True),
                    accumulation_error(k, bits, 128, n, positive=True)) for k in ks}


def draw_accumulation(ax, table: dict, bits: int = 13) -> None:
    ks = list(table)
    ax.loglog(ks, [table[k][0] for k in ks], "o-", label=f"{bits}-bit accumulator, no promotion")
    ax.loglog(ks, [table[k][1] for k in ks], "s-", label="promoted to FP32 every 128 (DeepSeek-V3)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("K (length of the dot product)")
    ax.set_ylabel("relative error vs FP64")
    ax.legend(fontsize=8)
    ax.set_title("limited accumulation precision, emulated")


def draw_training_study(axes, curves: dict) -> None:
    """Left: the loss curves of seed 0. Right: per step, each FP8 recipe's gap to BF16 (mean over the seeds)
    beside BF16's own seed-to-seed spread (sd of the loss over the seeds, relative to its mean)."""
    seeds = list(curves["BF16"])
    for name, runs in curves.items():
        axes[0].plot(runs[seeds[0]], label=name, lw=2 if name == "BF16" else 1, color="k" if name == "BF16" else None,
                     ls=":" if name == training.IDENTITY else "-")
    axes[0].set(xlabel="step", ylabel="loss", title=f"tiny GPT, seed {seeds[0]}, Adam lr {training.LR:g}")
    axes[0].legend(fontsize=7)
    bf16 = torch.tensor([curves["BF16"][s] for s in seeds], dtype=torch.float64)
    spread = bf16.std(0) / bf16.mean(0)
    steps = range(bf16.shape[1])
    axes[1].fill_between(steps, -spread, spread, color="0.85", label="± BF16's seed-to-seed sd")
    for name in curves:
        if name != "BF16":
            runs = torch.tensor([curves[name][s] for s in seeds], dtype=torch.float64)
            axes[1].plot(steps, ((runs - bf16) / bf16).mean(0), label=name,
                         ls=":" if name == training.IDENTITY else "-")
    axes[1].yaxis.set_major_formatter(lambda v, _: f"{v:+.1%}")
    axes[1].set(xlabel="step", ylabel="(FP8 − BF16) / BF16", title=f"gap to BF16, mean over {len(seeds)} seeds")
    axes[1].legend(fontsize=7)


def _granularities(path):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 5, figsize=(17, 3.6))
    draw_granularities(axes, *with_outliers(activation_matrix()))
    save_figure(fig, path, tight_layout=True)


def _accumulation(path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    draw_accumulation(ax, accumulation_table())
    save_figure(fig, path, tight_layout=True)


def _curves(path):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    draw_training_study(axes, training.run_study())
    save_figure(fig, path, tight_layout=True)


FIGURES = {"10b_granularities.png": _granularities, "10b_accumulation.png": _accumulation,
           "10b_training_curves.png": _curves}

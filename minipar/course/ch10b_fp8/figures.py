"""Chapter 10b pictures, from :mod:`minipar.precision`: the scales of the three granularities over a real
activation matrix of the tiny GPT, the accumulation error against K with and without promotion, and the
training curves of BF16 and the FP8 recipes."""
from __future__ import annotations


import torch

from minipar.course.plotting import save_figure
from minipar.precision.accumulation import accumulation_error
from minipar.precision.formats import E4M3
from minipar.precision.fp8 import GRANULARITIES, FP8Recipe, block_of, quantize

__all__ = ["activation_matrix", "draw_granularities", "accumulation_table", "draw_accumulation", "RECIPES",
           "training_curves", "draw_training_curves", "FIGURES"]

RECIPES = {"tensor-wise": FP8Recipe("tensor"), "row-wise": FP8Recipe("row"), "block-wise": FP8Recipe("block"),
           "tensor-wise, delayed (history 1)": FP8Recipe("tensor", "delayed", history=1)}


def activation_matrix() -> torch.Tensor:
    """The input of the first block's MLP down-projection (GeLU output, tokens × 512) of the 128-wide tiny
    GPT of the tour, on its first batch: a real activation matrix, recorded by a forward hook."""
    from minipar.course.ch10b_fp8.tour import recipe
    r = recipe()
    model, seen = r.model(), []
    model.blocks[0].mlp.proj.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach()))
    with torch.no_grad():
        model(r.batches[0][0])
    return seen[0].reshape(-1, seen[0].shape[-1])


def draw_granularities(axes, x: torch.Tensor) -> dict:
    """|x| and, per granularity, log2 of the scale each element is quantized with. Returns the fraction of
    non-zero values that land in E4M3's subnormals or at 0 under each granularity."""
    kw = dict(aspect="auto", interpolation="nearest", cmap="viridis")
    axes[0].imshow(torch.log2(x.abs() + 1e-12).numpy(), **kw)
    axes[0].set_title("log2 |x|  (tokens × channels)")
    lost = {}
    for ax, g in zip(axes[1:], GRANULARITIES):
        q = quantize(x, E4M3, block_of(g, x.shape, (1, 128)))
        ax.imshow(torch.log2(q.expanded_scale()).numpy(), **kw)
        small = (q.data.float().abs() < E4M3.smallest_normal) & (x != 0)
        lost[g] = float(small.sum()) / max(int((x != 0).sum()), 1)
        ax.set_title(f"{g}-wise: log2 scale\n{lost[g]:.1%} of values subnormal or 0")
    for ax in axes:
        ax.set_xlabel("channel")
    axes[0].set_ylabel("token")
    return lost


def accumulation_table(ks=(128, 512, 1024, 2048, 4096), bits: int = 13, n: int = 128) -> dict:
    """{K: (error without promotion, error with promotion every 128)} for ``bits``-bit accumulation of
    positive FP8 products (:func:`minipar.precision.accumulation.accumulation_error`)."""
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


def training_curves(steps: int | None = None) -> dict:
    """{name: losses} of the tour's recipe (``steps`` steps) in BF16 and under each of :data:`RECIPES`,
    plus {name: values saturated} under "saturated"."""
    from minipar.check import gpt_recipe
    from minipar.course.ch10b_fp8.tour import STEPS
    from minipar.precision.fp8_train import train_bf16, train_fp8
    r = gpt_recipe(steps=steps or STEPS, batch_size=8, n_embd=128)
    curves, saturated = {"BF16": train_bf16(r).losses}, {}
    for name, fp8 in RECIPES.items():
        result, saturated[name] = train_fp8(r, fp8)
        curves[name] = result.losses
    curves["saturated"] = saturated
    return curves


def draw_training_curves(ax, curves: dict) -> None:
    for name, losses in curves.items():
        if name != "saturated":
            ax.plot(losses, label=name, lw=2 if name == "BF16" else 1, color="k" if name == "BF16" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.set_title("tiny GPT (128 wide): BF16 vs FP8 GEMMs, same data")


def _granularities(path):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.5))
    draw_granularities(axes, activation_matrix())
    save_figure(fig, path, tight_layout=True)


def _accumulation(path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    draw_accumulation(ax, accumulation_table())
    save_figure(fig, path, tight_layout=True)


def _curves(path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    draw_training_curves(ax, training_curves())
    save_figure(fig, path, tight_layout=True)


FIGURES = {"10b_granularities.png": _granularities, "10b_accumulation.png": _accumulation,
           "10b_training_curves.png": _curves}

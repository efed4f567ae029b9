"""Chapter 10 pictures, from :mod:`minipar.precision`: the bit layouts of FP32 / FP16 / BF16 with a value
decoded into them, the range and the spacing of representable values of each format, and the histogram
of a real model's gradients against FP16's underflow threshold, before and after loss scaling, and the
smallest ratio w/u at which an update vanishes in FP16, measured for weights across three binades."""
from __future__ import annotations

import math

import torch

from minipar.course.plotting import save_figure
from minipar.precision.formats import FORMATS, FP16, decompose, round_to, spacing, vanishing_ratio

__all__ = ["draw_bit_layouts", "draw_ranges", "draw_spacing", "gradient_log2_values", "fp16_flushed_fraction",
           "draw_gradient_histogram", "draw_vanishing_ratios", "FIGURES"]

FIELD_COLOURS = {"sign": "#C44E52", "exponent": "#4C72B0", "mantissa": "#55A868"}
FORMAT_COLOURS = {"FP32": "#4C72B0", "FP16": "#DD8452", "BF16": "#55A868"}


def draw_bit_layouts(ax, value: float = -2.5) -> None:
    from matplotlib import patches
    """One row per format: a box per bit, coloured by field, holding the bit of ``value``."""
    for row, f in enumerate(FORMATS.values()):
        d = decompose(value, f)
        bits = d.bit_string.replace(" ", "")
        fields = ["sign"] + ["exponent"] * f.exponent_bits + ["mantissa"] * f.mantissa_bits
        y = -row * 1.6
        for i, (bit, field) in enumerate(zip(bits, fields)):
            ax.add_patch(patches.Rectangle((i, y), 1, 1, facecolor=FIELD_COLOURS[field],
                                                                    edgecolor="white", alpha=0.85))
            ax.text(i + 0.5, y + 0.5, bit, ha="center", va="center", fontsize=7, color="white")
        ax.text(-0.5, y + 0.5, f"{f.name} 1/{f.exponent_bits}/{f.mantissa_bits}", ha="right", va="center")
        ax.text(len(bits) + 0.5, y + 0.5, f"= {d.value:g}", ha="left", va="center", fontsize=8)
    ax.set_xlim(-9, 38)
    ax.set_ylim(-2 * 1.6 - 0.5, 1.5)
    ax.axis("off")
    handles = [patches.Patch(color=c, label=n) for n, c in FIELD_COLOURS.items()]
    ax.legend(handles=handles, loc="upper right", ncol=3, fontsize=8, frameon=False)
    ax.set_title(f"the bits of {value:g} in each format")


def draw_ranges(ax) -> None:
    """Log2 of the magnitudes each format can hold: subnormals (light), normals (dark), up to the max."""
    for row, f in enumerate(FORMATS.values()):
        lo, tiny, hi = math.log2(f.smallest_subnormal), math.log2(f.smallest_normal), math.log2(f.max)
        c = FORMAT_COLOURS[f.name]
        ax.barh(row, tiny - lo, left=lo, color=c, alpha=0.35)
        ax.barh(row, hi - tiny, left=tiny, color=c, alpha=0.9)
        ax.text(hi + 2, row, f"max {f.max:.3g}", va="center", fontsize=8)
        ax.text(lo - 2, row, f"{f.smallest_subnormal:.2g}", va="center", ha="right", fontsize=8)
    ax.set_yticks(range(len(FORMATS)), list(FORMATS))
    ax.set_xlabel("log2 |x|   (light: subnormal, dark: normal)")
    ax.set_xlim(-175, 160)
    ax.set_title("range of representable magnitudes")


def draw_spacing(ax) -> None:
    """The gap between neighbouring representable values, against the value (log-log)."""
    for f in FORMATS.values():
        xs = [2.0 ** (e / 4) for e in range(4 * int(math.log2(f.smallest_subnormal)), 4 * int(math.log2(f.max)))]
        ax.loglog(xs, [spacing(x, f) for x in xs], color=FORMAT_COLOURS[f.name], label=f.name)
    ax.axvline(FP16.max, color=FORMAT_COLOURS["FP16"], ls=":", lw=1)
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.text(2048, 1.3, "gap = 1: above 2048 FP16\nskips odd integers", fontsize=7)
    ax.set_xlim(1e-46, 1e39)
    ax.set_xlabel("value x")
    ax.set_ylabel("gap to the next value")
    ax.legend(fontsize=8)
    ax.set_title("spacing of representable values")


def gradient_log2_values(scale: float = 1.0):
    """log2 |g| of every non-zero FP32 parameter gradient of :func:`small_gradient_case` (times ``scale``)."""
    from minipar.precision.mixed import fp32_loss, small_gradient_case
    make, x, y = small_gradient_case()
    model = make()
    fp32_loss(model, x, y).backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters()]) * scale
    return torch.log2(g[g != 0].abs())


def fp16_flushed_fraction(loss_scale=None) -> float:
    """Fraction of :func:`small_gradient_case`'s gradient values that an FP16 backward (with
    ``loss_scale``, or none) returns as exactly zero while FP32 does not."""
    from minipar.precision.loss_scaler import DynamicLossScaler
    from minipar.precision.mixed import MixedPrecision, fp32_loss, small_gradient_case, underflow_fraction
    make, x, y = small_gradient_case()
    ref = make()
    fp32_loss(ref, x, y).backward()
    scaler = DynamicLossScaler(init_scale=loss_scale) if loss_scale else None
    mp = MixedPrecision(make(), lambda ps: torch.optim.SGD(ps, lr=0.0), torch.float16, scaler)
    mp.backward(fp32_loss(mp.model, x, y))
    return underflow_fraction([p.grad for p in mp.model.parameters()], [p.grad for p in ref.parameters()])


def draw_gradient_histogram(ax, loss_scale: float = 2.0 ** 16) -> None:
    lg = gradient_log2_values()
    bins = torch.arange(-60, 5, 1.0)
    ax.hist(lg.numpy(), bins=bins.numpy(), alpha=0.6, label="FP32 gradients")
    ax.hist((lg + math.log2(loss_scale)).numpy(), bins=bins.numpy(), alpha=0.5,
            label=f"× loss scale 2^{int(math.log2(loss_scale))}")
    ax.axvline(math.log2(FP16.smallest_subnormal), color="k", ls="--", lw=1)
    ax.axvline(math.log2(FP16.smallest_normal), color="k", ls=":", lw=1)
    lost = fp16_flushed_fraction()
    ax.text(math.log2(FP16.smallest_subnormal) - 1, ax.get_ylim()[1] * 0.9,
            f"FP16 flushes to 0 ←\n(measured in an FP16 backward:\n{lost:.0%} of the values)", ha="right",
            fontsize=8)
    ax.set_xlabel("log2 |gradient|   (dashed: FP16 smallest subnormal 2^-24; dotted: smallest normal 2^-14)")
    ax.set_ylabel("values")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("a nearly fitted model's gradients and FP16's underflow threshold")


def draw_vanishing_ratios(ax, fmt=FP16, lo: float = 0.5, hi: float = 4.0, n: int = 240) -> None:
    """For n weights w between lo and hi: the smallest ratio w/u at which w + u == w, measured in ``fmt``'s
    arithmetic (:func:`vanishing_ratio`), against the model 2·w / spacing(w) (half a gap)."""
    ws = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    measured = [vanishing_ratio(w, fmt) for w in ws]
    model = [2 * round_to(w, fmt) / spacing(round_to(w, fmt), fmt) for w in ws]
    m = fmt.mantissa_bits
    ax.plot(ws, model, color="grey", lw=1, label="model: 2·w / gap(w)")
    ax.scatter(ws, measured, s=6, color=FORMAT_COLOURS[fmt.name], label=f"measured in {fmt.name} arithmetic", zorder=3)
    for k in (m + 1, m + 2):
        ax.axhline(2 ** k, color="k", ls=":", lw=0.8)
        ax.text(hi, 2 ** k, f" 2^{k} = {2 ** k}", va="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("weight w (log2 scale)")
    ax.set_ylabel("smallest w/u with w + u == w")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"{fmt.name}: where an update vanishes depends on where w sits between powers of two")


def _figure(draw, figsize, tight=True, columns=1):
    """A figure generator: one figure of ``columns`` axes drawn by ``draw``, saved to the path it is given."""
    def make(path):
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, columns, figsize=figsize)
        draw(*(axes if columns > 1 else [axes]))
        save_figure(fig, path, tight_layout=tight, bbox_inches=None if tight else "tight")
    return make


def _draw_ranges(a, b):
    draw_ranges(a)
    draw_spacing(b)


_vanishing = _figure(draw_vanishing_ratios, (9, 3.5))
_layouts = _figure(draw_bit_layouts, (10, 3), tight=False)
_ranges = _figure(_draw_ranges, (12, 4), columns=2)
_histogram = _figure(draw_gradient_histogram, (9, 4))


FIGURES = {"10_bit_layouts.png": _layouts, "10_ranges_spacing.png": _ranges,
           "10_gradient_histogram.png": _histogram, "10_vanishing_updates.png": _vanishing}

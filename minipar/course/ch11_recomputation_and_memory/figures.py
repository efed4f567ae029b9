"""Chapter 11 picture: live memory through one training step (forward, then backward) of the 3-block tiny
GPT (sections 1-4's model), measured with :class:`minipar.memory.LiveTensorTracker`, without recomputation, with selective
(attention core) and with full (whole block) recomputation. Forward: activations pile up block after
block; backward: they are released while the parameters' gradients appear (what is left at the end); with
recomputation each block's activations come back briefly during its own backward — the bumps. And the
bytes one block keeps against the sequence length: measured beside the formula's linear and s² parts."""
from __future__ import annotations

import torch

from minipar.models import GPTConfig, TinyGPT
from minipar.recompute import MODES, apply_recompute, memory_timeline

__all__ = ["timelines", "draw_timelines", "draw_length_sweep", "FIGURES", "CONFIG"]

CONFIG = GPTConfig(n_layer=3, n_embd=64, n_head=4, block_size=64, dropout=0.1)
MODE_COLOURS = {"none": "#C44E52", "selective": "#DD8452", "full": "#4C72B0"}


def timelines(cfg: GPTConfig = CONFIG, batch: int = 4, seq: int = 64, seed: int = 0) -> dict:
    """{mode: (timeline, peak, backward_start)} for one step of the same model and batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(cfg.vocab_size, (batch, seq), generator=g)
    y = torch.randint(cfg.vocab_size, (batch, seq), generator=g)
    out = {}
    for mode in MODES:
        model = apply_recompute(TinyGPT(cfg, seed=seed), mode)
        torch.manual_seed(seed)
        out[mode] = memory_timeline(model, x, y)
    return out


def draw_timelines(ax, data: dict) -> None:
    """Live KiB against the operator count, forward and backward aligned at the start of backward."""
    for mode, (timeline, peak, bwd) in data.items():
        xs = [i - bwd for i, _, _ in timeline]
        ax.plot(xs, [b / 1024 for _, b, _ in timeline], color=MODE_COLOURS[mode], lw=1.2,
                label=f"{mode}: peak {peak / 1024:.0f} KiB")
    ax.axvline(0, color="grey", ls=":", lw=1)
    ax.text(8, ax.get_ylim()[1] * 0.95, "backward →", fontsize=8, va="top")
    ax.text(-8, ax.get_ylim()[1] * 0.95, "← forward", fontsize=8, va="top", ha="right")
    ax.set_xlabel("allocation and free events, not time (0 = start of backward)")
    ax.set_ylabel("live KiB created by the step")
    ax.legend(fontsize=8)
    ax.set_title("one training step's memory, measured: none / selective / full recomputation")


def draw_length_sweep(ax, sweep: dict, fused: dict | None = None) -> None:
    """``sweep``: {s: (measured bytes per block, linear part of the formula, s² part)}; ``fused``: optional
    {s: (unfused attention core bytes, fused core bytes)} drawn as the attention core alone."""
    lengths = sorted(sweep)
    kib = lambda v: [x / 1024 for x in v]  # noqa: E731
    linear = [sweep[s][1] for s in lengths]
    total = [sweep[s][1] + sweep[s][2] for s in lengths]
    ax.fill_between(lengths, 0, kib(linear), color="#4C72B0", alpha=0.3, label="formula: linear part sbh(16β + 2μ)")
    ax.fill_between(lengths, kib(linear), kib(total), color="#C44E52", alpha=0.3, label="formula: s² part as²b(2β + μ)")
    ax.plot(lengths, kib([sweep[s][0] for s in lengths]), "ko", label="measured, one block")
    if fused:
        ax.plot(lengths, kib([fused[s][0] for s in lengths]), "s--", color="#C44E52", ms=4,
                label="measured: unfused attention core alone")
        ax.plot(lengths, kib([fused[s][1] for s in lengths]), "s--", color="#55A868", ms=4,
                label="measured: fused (flash) attention core")
    ax.set_xticks(lengths, [str(s) for s in lengths])
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("KiB kept for backward")
    ax.set_xlim(0, lengths[-1] * 1.05)
    ax.legend(fontsize=8)
    ax.set_title("activations of one block against the sequence length (FP32, no recomputation)")


def _timeline(path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4))
    draw_timelines(ax, timelines())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


FIGURES = {"11_memory_timeline.png": _timeline}

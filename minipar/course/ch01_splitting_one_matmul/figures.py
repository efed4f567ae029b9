"""Chapter 01 pictures: which rank holds which block of x (4×5), w (5×8), y (4×8), dx and dw, drawn from the
pieces the ranks really held in a live run of :func:`minipar.tensor.matmul_split.run`.

Every matrix is drawn whole, in outline; the cells a rank holds take the rank's colour. A cell is placed
by finding the rank's piece inside the whole tensor (not from the split's formula); a piece with the whole
tensor's shape but other values is a partial sum (hatched, the rank's colour): the collective named between two
panels turns it into the real thing, a sum over ranks, drawn grey (chapter 00's rule: a sum belongs to no
rank). One figure per split, in the style of the OneFlow article's data/model-parallel pictures.
"""
from __future__ import annotations

import functools

import torch

from minipar.course.plotting import RANK_COLOURS
from minipar.tensor import matmul_split as ms

__all__ = ["holding_mask", "draw_split", "FIGURES"]

FORWARD = {"data": "no comm", "column": "no comm", "row": "all-reduce"}
BACKWARD = {"data": "all-reduce", "column": "all-reduce", "row": "no comm"}
GRADIENT = {"data": "dw", "column": "dx", "row": "dw"}   # the gradient whose backward we draw
SUM_COLOUR = "#BBBBBB"   # a sum over ranks: grey, as in chapter 00's collectives figure


def holding_mask(piece: torch.Tensor, whole: torch.Tensor):
    """(mask, kind): which cells of ``whole`` the ``piece`` is, found by value; kind is ``"exact"`` or
    ``"partial"`` (same shape as ``whole``, other values: a partial sum)."""
    h, w = piece.shape
    H, W = whole.shape
    for i in range(H - h + 1):
        for j in range(W - w + 1):
            if torch.allclose(whole[i:i + h, j:j + w], piece, rtol=1e-5, atol=1e-6):
                mask = torch.zeros(H, W, dtype=torch.bool)
                mask[i:i + h, j:j + w] = True
                return mask, "exact"
    if (h, w) == (H, W):
        return torch.ones(H, W, dtype=torch.bool), "partial"
    raise ValueError(f"a {h}×{w} piece is not a block of the {H}×{W} tensor")


def _draw_matrix(ax, x0, y0, mask, kind, colour, label):
    from matplotlib.patches import Rectangle
    H, W = mask.shape
    for i in range(H):
        for j in range(W):
            held = bool(mask[i, j])
            ax.add_patch(Rectangle((x0 + j, y0 - i - 1), 1, 1, edgecolor="white" if held else "#CCCCCC",
                                   facecolor=colour if held else "#F4F4F4", alpha=0.85 if held else 1.0,
                                   hatch="///" if held and kind == "partial" else None, lw=0.8))
    ax.text(x0 + W / 2, y0 + 0.4, label, ha="center", va="bottom", fontsize=8)


def draw_split(split: str, per_rank: list, whole: dict, ax=None):
    """One row per rank: x · w = y (this rank's product) ⇒ y after the forward's collective, and the
    gradient the backward communicates (dx for the column split, dw otherwise) before ⇒ after.
    ``per_rank`` is ``[r[split] for r in run(...)]``; ``whole`` has the single-device x, w, y, dx
    and dw."""
    import matplotlib.pyplot as plt
    n = len(per_rank)
    b, k = whole["x"].shape
    forward_op, backward_op = (FORWARD[split], BACKWARD[split])
    grad = GRADIENT[split]
    panels = [("x", "x", "·"), ("w", "w", "="), ("y", "y_local", f"⇒ {forward_op}"), ("y", "y_piece", ""),
              (grad, f"{grad}_local", f"⇒ {backward_op}"), (grad, f"{grad}_piece", "")]
    if ax is None:
        _, ax = plt.subplots(figsize=(16, 1.9 * n + 0.6))
    row_h = max(b, k) + 2.5
    for rank, r in enumerate(per_rank):
        top = -rank * row_h
        colour = RANK_COLOURS[rank % len(RANK_COLOURS)]
        x0 = 0.0
        previous_kind = None
        for i, (name, key, after) in enumerate(panels):
            mask, kind = holding_mask(r[key], whole[name])
            shape = "×".join(map(str, r[key].shape))
            when = "" if key in ("x", "w") else (" local" if key.endswith("local") else " after")
            summed = key.endswith("_piece") and previous_kind == "partial"   # partial sums in, their sum out
            note = " partial Σ" if kind == "partial" else (" Σ ranks" if summed else "")
            _draw_matrix(ax, x0, top, mask, kind, SUM_COLOUR if summed else colour, f"{name}{when} {shape}{note}")
            previous_kind = kind
            x0 += mask.shape[1]
            gap = 1.5 if len(after) <= 1 else 4.5
            if after:
                ax.text(x0 + gap / 2, top - mask.shape[0] / 2, after, ha="center", va="center",
                        fontsize=14 if len(after) == 1 else 8)
            x0 += gap if after else 3
        ax.text(-0.6, top - b / 2, f"rank {rank}", ha="right", va="center", fontsize=9, color=colour)
    ax.set_xlim(-3, x0)
    ax.set_ylim(-(n - 1) * row_h - row_h + 1.5, 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"{split} split on {n} ranks: forward y: {forward_op}; backward {grad}: {backward_op} "
                 f"(hatched: a rank's partial sum; grey: the sum over ranks; live run)", fontsize=10)
    return ax.figure


@functools.lru_cache(maxsize=4)
def seed_example(world_size: int = 2):
    """The OneFlow article's example x (4×5) · w (5×8), one live run of every split; returns (whole, per_rank)."""
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((4, 5), (5, 8), (4, 8)))
    whole = {"x": x, "w": w, "y": x @ w, "dx": dy @ w.T, "dw": x.T @ dy}
    return whole, ms.run(x, w, dy, world_size=world_size)


def _make(split: str, path, world_size: int = 2):
    import matplotlib.pyplot as plt
    whole, per_rank = seed_example(world_size)
    fig = draw_split(split, [r[split] for r in per_rank], whole)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


FIGURES = {f"01_matmul_{s}.png": functools.partial(_make, s) for s in ms.SPLITS}

"""Chapter 07 pictures, from the library's own placement functions and from live runs.

* ``07_grids.png`` — who holds which element of X (tokens × features), W = Aᵀ's A (in × out) and Y on
  2D (4 ranks), 2.5D (q=2, d=2) and 3D (q=2): computed by cutting index matrices with
  :func:`minipar.tensor.tp2d.block`, :func:`~minipar.tensor.tp2p5d.x_block` and
  :func:`~minipar.tensor.tp3d.piece` — the same functions the layers use.
* ``07_summa_steps.png`` — SUMMA on a live 2×2 grid: in each step, the blocks each rank received and its
  running Y_ij (from :func:`summa_trace`).
* ``07_alpha_beta.png`` — a **model**, not a measurement: communication time per rank of one transformer
  MLP (h → 4h → h, fp16) for P = 8 … 512 on an α-β link (:func:`minipar.tensor.multidim_measure.link_time`),
  for a large and a small number of tokens per step.
"""
from __future__ import annotations

import math

import torch

from minipar.course.plotting import save_figure
from minipar.launcher import launch

__all__ = ["owners", "draw_grids", "summa_trace", "draw_summa", "alpha_beta_table", "draw_alpha_beta",
           "FIGURES", "LINK", "valid_world"]

COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
LINK = {"alpha_sync": 20e-6, "alpha_msg": 5e-6, "beta": 25e9}   # assumed: 20 µs per collective, 5 µs per message, 25 GB/s


def owners(layout: str, shapes=((8, 4), (4, 4), (8, 4))) -> list:
    """[(name, list of owner lists per element)] for X, A, Y: which ranks hold each element."""
    from minipar.tensor import tp2d, tp2p5d, tp3d
    from minipar.tensor.multidim_mlp import make_grid
    world = {"2d": 4, "2.5d": 8, "3d": 8}[layout]
    mesh = make_grid(layout, world)
    out = []
    for name, (r, c) in zip(("X", "A = Wᵀ", "Y"), shapes):
        ids = torch.arange(r * c).view(r, c)
        held = [[[] for _ in range(c)] for _ in range(r)]
        for rank in range(world):
            co = mesh.coords(rank)
            if layout == "2d":
                part = tp2d.block(ids, co["i"], co["j"], 2)
            elif layout == "2.5d":
                part = (tp2d.block(ids, co["i"], co["j"], 2) if name.startswith("A")
                        else tp2p5d.x_block(ids, co["k"], co["i"], co["j"], 2, 2))
            else:
                m, k, n = co["x"], co["y"], co["z"]            # layer 0's roles (x, y, z)
                part = {"X": tp3d.piece(ids, m, k, n, 2), "Y": tp3d.piece(ids, m, n, k, 2)}.get(
                    name, tp3d.piece(ids, k, n, m, 2))
            for e in part.flatten().tolist():
                held[e // c][e % c].append(rank)
        out.append((name, held))
    return out


def draw_grids():
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    layouts = ("2d", "2.5d", "3d")
    fig, axes = plt.subplots(3, 3, figsize=(10, 10))
    titles = {"2d": "2D, q=2 (4 ranks)", "2.5d": "2.5D, q=2, d=2 (8 ranks)", "3d": "3D, q=2 (8 ranks), layer 0"}
    for row, layout in enumerate(layouts):
        for col, (name, held) in enumerate(owners(layout)):
            ax = axes[row][col]
            r, c = len(held), len(held[0])
            for y in range(r):
                for x in range(c):
                    who = held[y][x]
                    ax.add_patch(Rectangle((x, r - 1 - y), 1, 1, fc=COLOURS[who[0]], ec="white", alpha=0.85))
                    ax.text(x + 0.5, r - 0.5 - y, ",".join(map(str, who)), ha="center", va="center", fontsize=8,
                            color="white")
            ax.set_xlim(0, c), ax.set_ylim(0, r), ax.set_aspect("equal"), ax.set_xticks([]), ax.set_yticks([])
            ax.set_title(f"{titles[layout]}: {name}", fontsize=9)
    fig.suptitle("Who holds which element (numbers: ranks). 2.5D: A replicated over depth (r and r+4). "
                 "3D: every element of X, A and Y on one rank", fontsize=9)
    fig.tight_layout()
    return fig


def _trace(rank, world_size, x, a):
    from minipar.tensor.grid import build, grid_2d
    from minipar.tensor.tp2d import block, summa_step
    g = build(grid_2d(world_size), rank)
    q, i, j = g.size("i"), g.coord("i"), g.coord("j")
    xb, ab = block(x, i, j, q), block(a, i, j, q)
    acc, steps = xb.new_zeros(xb.shape[0], ab.shape[1]), []
    for k in range(q):
        acc = summa_step(k, xb, ab, acc, g)
        steps.append({"x_from": g.rank_at(j=k), "a_from": g.rank_at(i=k), "acc": acc.clone()})
    return steps


def summa_trace(seed: int = 0):
    """(X, A, per-rank per-step {x_from, a_from, acc}) from a live 2×2 run of :func:`tp2d.summa_step`."""
    g = torch.Generator().manual_seed(seed)
    x, a = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)
    return x, a, launch(_trace, 4, x, a, quiet=True)


def draw_summa(trace=None, steps=None):
    """One column per SUMMA step: each rank (i, j), where its X and A blocks came from, and its Y_ij so far."""
    import matplotlib.pyplot as plt
    x, a, per_rank = trace or summa_trace()
    q = 2
    steps = list(range(q)) if steps is None else list(steps)
    fig, axes = plt.subplots(q, q * len(steps), figsize=(3.2 * len(steps) * q / 2 + 1.8, 5.0), squeeze=False)
    image = None
    for s_i, k in enumerate(steps):
        for rank, trace_r in enumerate(per_rank):
            i, j = divmod(rank, q)
            ax = axes[i][s_i * q + j]
            st = trace_r[k]
            image = ax.imshow(st["acc"], cmap="RdBu", vmin=-4, vmax=4)
            ax.set_xticks([]), ax.set_yticks([])
            ax.set_title(f"step {k}, rank ({i},{j})\nX from {st['x_from']}, A from {st['a_from']}", fontsize=8,
                         color=COLOURS[rank])
    fig.suptitle("SUMMA, live on 2×2: step k broadcasts X_ik along each row and A_kj down each column; "
                 "each rank adds X_ik A_kj to its Y_ij (shown)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    bar = fig.colorbar(image, cax=fig.add_axes((0.92, 0.15, 0.02, 0.7)))
    bar.set_label("value of an element of Y_ij so far", fontsize=8)
    return fig


def valid_world(layout: str, p: int) -> bool:
    if layout == "1d":
        return True
    if layout == "2d":
        return math.isqrt(p) ** 2 == p
    if layout == "2.5d":
        return p % 2 == 0 and math.isqrt(p // 2) ** 2 == p // 2
    q = round(p ** (1 / 3))
    return q ** 3 == p


def alpha_beta_table(tokens: int, hidden: int = 8192, worlds=(8, 16, 27, 32, 64, 125, 128, 216, 256, 343, 512),
                     link: dict | None = None) -> dict:
    """{layout: [(P, seconds, counts)]} for one MLP (h → 4h → h, fp16, 2.5D with d = 2) on the α-β link."""
    from minipar.tensor.multidim_measure import counts, link_time
    from minipar.tensor.multidim_mlp import LAYOUTS
    link = link or LINK
    out = {}
    for layout in LAYOUTS:
        rows = []
        for p in worlds:
            if valid_world(layout, p):
                c = counts(layout, p, sizes=(hidden, 4 * hidden, hidden), tokens=tokens, depth=2, value_bytes=2)
                rows.append((p, link_time(c, **link), c))
        out[layout] = rows
    return out


def draw_alpha_beta(token_counts=(16384, 2048, 256), hidden: int = 8192):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(token_counts), figsize=(4.2 * len(token_counts), 3.8), sharey=False)
    for ax, tokens in zip(axes, token_counts):
        for colour, (layout, rows) in zip(COLOURS, alpha_beta_table(tokens, hidden).items()):
            ax.plot([p for p, _, _ in rows], [t * 1e3 for _, t, _ in rows], "o-", color=colour, label=layout)
        ax.set_xscale("log", base=2), ax.set_yscale("log")
        ax.set_xlabel("ranks P"), ax.set_title(f"{tokens} tokens, h = {hidden}", fontsize=9)
    axes[0].set_ylabel("communication ms per MLP fwd+bwd (model)")
    axes[0].legend(fontsize=8)
    fig.suptitle("α-β model (20 µs per collective, 5 µs per message, 25 GB/s; fp16): not a measurement", fontsize=9)
    fig.tight_layout()
    return fig


def _save(draw):
    return lambda path: save_figure(draw(), path, dpi=100, bbox_inches="tight")


FIGURES = {"07_grids.png": _save(draw_grids), "07_summa_steps.png": _save(draw_summa),
           "07_alpha_beta.png": _save(draw_alpha_beta)}

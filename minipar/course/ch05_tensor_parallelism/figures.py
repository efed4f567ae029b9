"""Chapter 05 pictures, from live runs.

* ``05_column_parallel_gelu.png`` — Y = GeLU(X A) with A split by columns on 2 ranks: X, each rank's
  columns of A and the GeLU of its product, as the ranks held them (Megatron's figure, as the Hugging Face guide shows it).
* ``05_allreduce_cost.png`` — all-reduce time vs message size measured on 4 CPU ranks (gloo), median
  [min–max] of repeated calls at eleven sizes, with the ring's α-β line (2(N-1)·α + 2(N-1)/N·S/β, the
  library's :func:`minipar.machine.fidelity.fit_link`) fitted to each size's fastest call;
  beside it a model: tokens/s per GPU of a GPT-3-shaped model against the TP degree, inside a node and
  across nodes (:mod:`.throughput`: the planner's estimate on A100 and H100 cards).
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from minipar.launcher import launch
from minipar.machine.fidelity import fit_link
from minipar.observe.measure import calibrate_links

__all__ = ["column_gelu_shards", "draw_column_gelu", "mlp_shards", "draw_mlp_split", "allreduce_timings",
           "fit_latency_bandwidth", "draw_allreduce_cost", "draw_tp_throughput", "FIGURES"]

from minipar.course.plotting import RANK_COLOURS


def _column_shard(rank, world_size, x, a):
    from minipar.mesh import Mesh
    from minipar.tensor.layers import ColumnParallelLinear

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    layer = ColumnParallelLinear(a.t(), None, group)        # nn.Linear stores Aᵀ
    return layer.weight.detach().t(), F.gelu(layer(x)).detach()


def column_gelu_shards(world_size: int = 2, seed: int = 0):
    """(X, A, [(A_i, GeLU(X A_i)) per rank]) from a live run; the concatenation equals GeLU(X A)."""
    g = torch.Generator().manual_seed(seed)
    x, a = torch.randn(4, 6, generator=g), torch.randn(6, 8, generator=g)
    shards = launch(_column_shard, world_size, x, a, quiet=True)
    assert torch.allclose(torch.cat([y for _, y in shards], dim=1), F.gelu(x @ a), atol=1e-6)
    return x, a, shards


def draw_column_gelu(world_size: int = 2):
    """The figure (a matplotlib Figure) of Y = GeLU(XA) from a live run on ``world_size`` ranks."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    x, a, shards = column_gelu_shards(world_size)
    fig, axes = plt.subplots(1, 2 + world_size, figsize=(3 + 2.2 * (1 + world_size), 3.2),
                             gridspec_kw={"width_ratios": [6, 8] + [8 // world_size] * world_size})
    panels = [("X (every rank)", x, None), ("A, split by columns", a, "split")]
    panels += [(f"rank {r}: GeLU(X A_{r + 1})", y, r) for r, (_, y) in enumerate(shards)]
    for ax, (title, m, who) in zip(axes, panels):
        ax.imshow(m, cmap="Greys", vmin=-3, vmax=3)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
        cols = m.shape[1] // world_size
        for r in range(world_size):
            if who == "split" or who == r:
                x0 = r * cols - 0.5 if who == "split" else -0.5
                ax.add_patch(Rectangle((x0, -0.5), cols, m.shape[0], fill=False, lw=3, ec=RANK_COLOURS[r]))
    fig.suptitle("Y = GeLU(XA): each rank multiplies X by its columns of A and applies GeLU on its own "
                 "(no communication)", fontsize=9)
    return fig


def _make_column(path):
    fig = draw_column_gelu()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def _mlp_shard(rank, world_size, fc, proj, x):
    from minipar.mesh import Mesh
    from minipar.tensor.layers import TensorParallelMLP

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    mlp = TensorParallelMLP(fc, proj, group)
    y = F.gelu(mlp.fc(x))
    with torch.no_grad():
        return {"A": mlp.fc.weight.t().clone(), "Y": y.detach(), "B": mlp.proj.weight.t().clone(),
                "partial": (y @ mlp.proj.weight.t()).detach(), "Z": (mlp(x) - proj.bias).detach()}


def mlp_shards(world_size: int = 2, h: int = 4, seed: int = 0):
    """(X, Z = GeLU(XA)B without its bias, [each rank's {"A", "Y", "B", "partial", "Z"}]) from a live run of
    :class:`minipar.tensor.layers.TensorParallelMLP` (h → 4h → h) on ``world_size`` ranks."""
    g = torch.Generator().manual_seed(seed)
    fc, proj = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)
    with torch.no_grad():
        for p in (*fc.parameters(), *proj.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3, h, generator=g)
    shards = launch(_mlp_shard, world_size, fc, proj, x, quiet=True)
    z = (F.gelu(fc(x)) @ proj.weight.t()).detach()
    assert torch.allclose(sum(r["partial"] for r in shards), z, atol=1e-5)
    assert all(torch.allclose(r["Z"], z, atol=1e-5) for r in shards)
    return x, z, shards


def draw_mlp_split(world_size: int = 2):
    """Megatron's MLP split (Shoeybi et al. 2019, fig. 3a) drawn from a live run: X whole on every rank (f), each
    rank's columns of A, GeLU(XA_i), its rows of B and its partial Y_iB_i, and g's sum Z on every rank."""
    import matplotlib.pyplot as plt

    x, z, shards = mlp_shards(world_size)
    cols = ["X  (f: whole on\nevery rank)", "A_i: columns", "Y_i = GeLU(X A_i)", "B_i: rows", "Y_i B_i (partial)",
            "Z = Σ_i Y_i B_i\n(g: all-reduce)"]
    fig, axes = plt.subplots(world_size, len(cols), figsize=(11, 1.6 * world_size + 0.6), squeeze=False)
    for r, shard in enumerate(shards):
        for c, m in enumerate((x, shard["A"], shard["Y"], shard["B"], shard["partial"], shard["Z"])):
            ax, scale = axes[r][c], float(m.abs().max())
            ax.imshow(m, cmap="Greys", vmin=-scale, vmax=scale)
            ax.set_xticks([]), ax.set_yticks([])
            for side in ax.spines.values():
                side.set_edgecolor(RANK_COLOURS[r] if 1 <= c <= 4 else "k"), side.set_linewidth(2.5 if 1 <= c <= 4 else 1)
            if r == 0:
                ax.set_title(cols[c], fontsize=8)
            if c == 0:
                ax.set_ylabel(f"rank {r}", fontsize=8)
    fig.suptitle("The MLP, column-parallel then row-parallel: f before (identity forward), GeLU on each rank's "
                 "columns, g after (one all-reduce)", fontsize=9)
    return fig


def allreduce_timings(world_size: int = 4, sizes=tuple(4 ** k for k in range(1, 12)), reps: int = 5) -> dict:
    """{message bytes: [seconds of each of ``reps`` float32 all-reduces of ``sizes`` floats]} measured on
    ``world_size`` ranks at once, each call after a barrier, its time the mean of the ranks' clocks of it
    (:func:`minipar.observe.measure.calibrate_links`, one warm-up call first)."""
    links = calibrate_links(world_size, sizes=[4 * n for n in sizes], repeats=reps, ops=("all_reduce",),
                            p2p_sizes=None)
    per_rank = [calls["all_reduce"] for calls in links.calls]
    return {size: [statistics.fmean(r[size][i] for r in per_rank) for i in range(reps)] for size in per_rank[0]}


def fit_latency_bandwidth(timings: dict, world_size: int = 4):
    """(α seconds of one ring step, β bytes/second) of ``t = 2(N-1)·α + 2(N-1)/N · S / β`` — the ring's form,
    the one chapter 00 and the cluster model price every all-reduce by — fitted by the library's
    :func:`minipar.machine.fidelity.fit_link` to the **fastest** of each size's calls (the least contended: on
    shared CPU cores a slower call waited for a core, not for the link). A size may be given one time or a list
    of repeats."""
    fastest = {s: min(v) if isinstance(v, (list, tuple)) else v for s, v in timings.items()}
    beta, alpha = fit_link("all_reduce", world_size, fastest)
    return alpha, beta


def _plot_measured(ax, timings: dict, world_size: int) -> None:
    alpha, beta = fit_latency_bandwidth(timings, world_size)
    steps, share = 2 * (world_size - 1), 2 * (world_size - 1) / world_size
    sizes = list(timings)
    med = [statistics.median(timings[s]) * 1e3 for s in sizes]
    lo = [m - min(timings[s]) * 1e3 for m, s in zip(med, sizes)]
    hi = [max(timings[s]) * 1e3 - m for m, s in zip(med, sizes)]
    ax.errorbar(sizes, med, yerr=[lo, hi], fmt="o", ms=4, capsize=2,
                label=f"measured, {world_size} CPU ranks (gloo): median [min–max] of {len(timings[sizes[0]])} calls")
    ax.plot(sizes, [(steps * alpha + share * s / beta) * 1e3 for s in sizes], "-",
            label="fit to each size's fastest call: 2(N-1)·α + 2(N-1)/N·S/β (rough: shape only)")
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("one all-reduce (ms)")
    ax.legend(fontsize=7)
    ax.set_title("Measured: a fixed latency, then time grows with S", fontsize=9)


def _plot_model(ax, rows: list) -> None:
    for (card, placement), style in zip(sorted({(r["card"], r["placement"]) for r in rows}),
                                        ("o-", "s--", "o-", "s--")):
        mine = [r for r in rows if (r["card"], r["placement"]) == (card, placement)]
        ax.plot([r["t"] for r in mine], [r["tokens_per_gpu"] for r in mine], style,
                label=f"{card.split(' (')[0]}, {placement}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["t"] for r in mine], [str(r["t"]) for r in mine])
    if min(r["t"] for r in rows) == 1:          # the planner prices time only: t = 1's weights exceed an 80 GB card
        ax.axvspan(2 ** -0.4, 2 ** 0.4, color="0.9", zorder=0)
        ax.text(1, 0.02, "does not fit:\ncompute only", transform=ax.get_xaxis_transform(), ha="center", fontsize=7)
    ax.set_xlabel("TP degree t")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title("Model (the planner): a GPT-3-shaped model (h = 12288, s = 2048), TP alone", fontsize=9)
    ax.legend(fontsize=7)


def draw_allreduce_cost(timings: dict, world_size: int = 4):
    """The measured all-reduce times (median of the repeats, bars from the fastest to the slowest call) and the
    α-β fit to each size's fastest call (:func:`fit_latency_bandwidth`)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    _plot_measured(ax, timings, world_size)
    return fig


def draw_tp_throughput(rows: list):
    """``rows`` of :func:`minipar.course.ch05_tensor_parallelism.throughput.tp_throughput` (a model): tokens/s
    per GPU of a GPT-3-shaped model against the TP degree, on 8-GPU nodes and on 2-GPU nodes (a what-if)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.8))
    _plot_model(ax, rows)
    return fig


def _make_allreduce(path):
    import matplotlib.pyplot as plt
    from .throughput import tp_throughput
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    _plot_measured(axes[0], allreduce_timings(reps=7), 4)    # as the chapter: 7 calls a size
    _plot_model(axes[1], tp_throughput())
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


FIGURES = {"05_column_parallel_gelu.png": _make_column, "05_allreduce_cost.png": _make_allreduce}

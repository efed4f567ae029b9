"""Chapter 05 pictures, from live runs.

* ``05_column_parallel_gelu.png`` — Y = GeLU(X A) with A split by columns on 2 ranks: X, each rank's
  columns of A and the GeLU of its product, as the ranks held them (Megatron's figure, seed 002).
* ``05_allreduce_cost.png`` — all-reduce time vs message size measured on 4 CPU ranks (gloo), with the
  fitted latency + size/bandwidth line; beside it a simulated cluster: one GPT-3 layer's TP all-reduces
  on a node-local vs an inter-node link, against its compute (stated assumptions, :func:`tp_layer_times`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minipar.launcher import launch
from minipar.observe.measure import calibrate_links

__all__ = ["column_gelu_shards", "draw_column_gelu", "allreduce_timings", "fit_latency_bandwidth", "tp_layer_times", "LINKS",
           "draw_allreduce_cost", "FIGURES"]

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


def allreduce_timings(world_size: int = 4, sizes=tuple(4 ** k for k in range(5, 12)), reps: int = 5) -> dict:
    """{message bytes: seconds of one float32 all-reduce of ``sizes`` floats} measured on ``world_size`` ranks
    (the best of ``reps`` calls, mean over ranks: :func:`minipar.observe.measure.calibrate_links`)."""
    links = calibrate_links(world_size, sizes=[4 * n for n in sizes], repeats=reps, ops=("all_reduce",),
                            p2p_sizes=None)
    return links.seconds("all_reduce", min)


def fit_latency_bandwidth(timings: dict, world_size: int = 4):
    """Least squares ``t = α + 2(N-1)/N · S / β``: returns (α seconds, β bytes/second)."""
    sizes = torch.tensor([2 * (world_size - 1) / world_size * s for s in timings], dtype=torch.float64)
    secs = torch.tensor(list(timings.values()), dtype=torch.float64)
    design = torch.stack([torch.ones_like(sizes), sizes], dim=1)
    alpha, inv_beta = torch.linalg.lstsq(design, secs.unsqueeze(1)).solution.squeeze(1).tolist()
    return max(alpha, 0.0), 1 / inv_beta if inv_beta > 0 else float("inf")


# A simulated cluster (stated assumptions, not measurements): one GPT-3-sized layer, 16-bit activations.
LINKS = {"inside a node (NVLink-class, 300 GB/s)": 300e9, "across nodes (InfiniBand-class, 25 GB/s)": 25e9}


def tp_layer_times(t: int, bandwidth: float, b: int = 1, s: int = 2048, h: int = 12288,
                   flops: float = 312e12, latency: float = 10e-6) -> dict:
    """Seconds per layer per step on t devices: compute = 3 · (24bsh² + 4bs²h) / t / flops (forward +
    backward ≈ 3 forwards); communication = 4 all-reduces of b·s·h 2-byte values over a link of
    ``bandwidth`` bytes/s: 4 · (α + 2(t-1)/t · 2bsh / bandwidth). Not overlapped (Megatron's TP
    all-reduces sit on the critical path)."""
    compute = 3 * (24 * b * s * h * h + 4 * b * s * s * h) / t / flops
    comm_time = 4 * (latency + 2 * (t - 1) / t * 2 * b * s * h / bandwidth) if t > 1 else 0.0
    return {"compute": compute, "communication": comm_time}


def draw_allreduce_cost(timings: dict, gpus_per_node: int = 8):
    """Left: the measured all-reduce times and their α-β fit (from ``timings``, the run being shown).
    Right: the simulated TP layer of :func:`tp_layer_times`; no inside-a-node bar where t > gpus_per_node."""
    import matplotlib.pyplot as plt

    alpha, beta = fit_latency_bandwidth(timings)
    sizes = list(timings)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax.loglog(sizes, [timings[s] * 1e3 for s in sizes], "o", label="measured, 4 CPU ranks (gloo)")
    ax.loglog(sizes, [(alpha + 1.5 * s / beta) * 1e3 for s in sizes], "-",
              label=f"fit: {alpha * 1e3:.2f} ms + 2(N-1)/N·S / ({beta / 1e9:.2f} GB/s)")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("one all-reduce (ms)")
    ax.legend(fontsize=7)
    ax.set_title("Measured: a fixed latency, then time grows with S", fontsize=9)
    degrees = [2, 4, 8, 16]
    width = 0.27
    for k, (name, bw) in enumerate(LINKS.items()):
        fits = [t for t in degrees if k == 1 or t <= gpus_per_node]
        comm_ms = [tp_layer_times(t, bw)["communication"] * 1e3 for t in fits]
        ax2.bar([degrees.index(t) + (k - 0.5) * width for t in fits], comm_ms, width, label=f"all-reduces, {name}")
    compute_ms = [tp_layer_times(t, 1)["compute"] * 1e3 for t in degrees]
    ax2.plot(range(len(degrees)), compute_ms, "k^-", label="compute per device (312 TFLOP/s, 100 % of peak)")
    ax2.set_xticks(range(len(degrees)), [f"t = {t}" for t in degrees])
    ax2.set_ylabel("ms per layer per step")
    ax2.set_title(f"Simulated: GPT-3 layer (s=2048, h=12288); {gpus_per_node} GPUs per node", fontsize=9)
    ax2.legend(fontsize=7)
    return fig


def _make_allreduce(path):
    draw_allreduce_cost(allreduce_timings()).savefig(path, dpi=110, bbox_inches="tight")


FIGURES = {"05_column_parallel_gelu.png": _make_column, "05_allreduce_cost.png": _make_allreduce}

"""Chapter 00 pictures, drawn from real runs on 4 ranks.

* ``00_collectives.png``: for each collective, who holds what before and after, drawn from the tensors the
  ranks really held (inputs 10·rank + 1, 2, ... so every number says where it came from: a cell takes the
  colour of the rank it came from; a sum over ranks is grey).
* ``00_ring_vs_root.png``: bytes sent by the busiest rank for one all-reduce of S bytes as N grows, measured
  in the communication log: the ring stays under 2S, a root (parameter server) sends (N-1)·S.
"""
from __future__ import annotations

from minipar.course.plotting import RANK_COLOURS, save_figure

from .tour import COLLECTIVES, busiest_rank_traffic, run_collectives

__all__ = ["DIAGRAM_OPS", "draw_holdings", "draw_collective", "collectives_figure", "traffic_sweep",
           "plot_traffic", "plot_ring_time", "FIGURES"]

DIAGRAM_OPS = ["broadcast", "scatter", "gather", "reduce", "all_reduce", "all_gather", "reduce_scatter",
               "all_to_all", "send/recv"]
SUM_COLOUR = "#BBBBBB"


def draw_holdings(ax, tensors, title: str, exact: bool, width: int | None = None) -> None:
    """One row per rank, one cell per element, the value written in it. ``exact``: the values were only
    moved, so colour each cell by the rank it came from (value // 10); otherwise they are sums (grey).
    ``None`` (nothing defined on that rank) is drawn as a dash."""
    from matplotlib.patches import Rectangle
    n = len(tensors)
    width = width or max(1 if t is None else t.numel() for t in tensors)
    for rank, t in enumerate(tensors):
        y = n - 1 - rank
        ax.text(-0.3, y + 0.5, f"rank {rank}", ha="right", va="center", fontsize=8)
        if t is None:
            ax.text(0.1, y + 0.5, "— (nothing defined)", va="center", fontsize=7, color="#666666")
            continue
        for i, v in enumerate(t.tolist()):
            source = int(v) // 10
            colour = RANK_COLOURS[source % len(RANK_COLOURS)] if exact and source < n else SUM_COLOUR
            ax.add_patch(Rectangle((i, y + 0.08), 0.92, 0.84, facecolor=colour, alpha=0.75, edgecolor="white"))
            ax.text(i + 0.46, y + 0.5, f"{v:g}", ha="center", va="center", fontsize=7)
    ax.set_xlim(-2.2, width)
    ax.set_ylim(0, n)
    ax.set_title(title, fontsize=9)
    ax.axis("off")


def draw_collective(name: str, outcome: list, axes=None):
    """Before | after for one operation; ``outcome`` is ``run_collectives(...)[name]``. Returns the figure."""
    import matplotlib.pyplot as plt
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(8, 1.6), gridspec_kw={"wspace": 0.3})
    fig = axes[0].figure
    width = max(t.numel() for o in outcome for t in (o["before"], o["after"]) if t is not None)
    draw_holdings(axes[0], [o["before"] for o in outcome], f"{name}: before", True, width)
    draw_holdings(axes[1], [o["after"] for o in outcome], f"{name}: after", COLLECTIVES[name].exact, width)
    return fig


def collectives_figure(outcomes: dict | None = None):
    """Every collective of :data:`DIAGRAM_OPS`, before and after, in one figure (a fresh 4-rank run by
    default)."""
    import matplotlib.pyplot as plt
    outcomes = outcomes or run_collectives(4, DIAGRAM_OPS, numel=8, values="small")
    fig, axes = plt.subplots(len(DIAGRAM_OPS), 2, figsize=(9, 1.45 * len(DIAGRAM_OPS)),
                             gridspec_kw={"wspace": 0.25, "hspace": 0.55})
    for row, name in zip(axes, DIAGRAM_OPS):
        draw_collective(name, outcomes[name], row)
    fig.subplots_adjust(top=0.95, bottom=0.01)
    fig.suptitle("Who holds what, before and after each collective (4 ranks; measured)", y=0.985)
    return fig


def traffic_sweep(sizes=(2, 3, 4, 6, 8), numel: int = 3 * 2**13) -> dict:
    """{N: busiest_rank_traffic(N, numel)}: one launch per N, ring all-reduce and root all-reduce."""
    return {n: busiest_rank_traffic(n, numel) for n in sizes}


def plot_traffic(sweep: dict, payload_bytes: int, ax=None):
    """Measured bytes sent by the busiest rank (markers) against the formulas (lines), in units of S."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.8))
    ns = sorted(sweep)
    s = payload_bytes
    ax.plot(ns, [max(sweep[n]["root"]["sent"]) / s for n in ns], "o", color="#C44E52", ms=8,
            label="root (reduce to rank 0, send back): measured")
    ax.plot(ns, [n - 1 for n in ns], "-", color="#C44E52", alpha=0.5, label="(N-1)·S")
    ax.plot(ns, [max(sweep[n]["ring"]["sent"]) / s for n in ns], "s", color="#4C72B0", ms=8,
            label="ring all-reduce: measured")
    ax.plot(ns, [2 * (n - 1) / n for n in ns], "-", color="#4C72B0", alpha=0.5, label="2(N-1)/N·S")
    ax.axhline(2, ls=":", color="#4C72B0", alpha=0.6, label="2S")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("bytes sent by the busiest rank (× S)")
    ax.set_title(f"One all-reduce of S = {s / 2**10:.0f} KiB, bytes counted per message")
    ax.set_xticks(ns)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax.figure


def plot_ring_time(sizes: dict, sweep: dict, payload_bytes: int, cores: int | None = None):
    """Two panels. Left: a ring all-reduce on 2 ranks against its size S, measured (markers) and the model
    2(N−1)·α + 2(N−1)/N·S/β fitted to them (line, :func:`.latency.fit_ring`), and the crossover S* = N·α·β.
    Right: the same α and β against N for a 4 KiB and an S-byte ring (lines), beside the times measured at each N
    for N up to ``cores`` only (beyond them a rank also waits for a core, so the time is not the ring's)."""
    import matplotlib.pyplot as plt
    from .latency import FIT_RANKS, SMALL_BYTES, crossover_bytes, fit_ring, fitted_ranks, machine_cores, \
        ring_model_seconds
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    alpha, beta = fit_ring(sizes)
    ss = sorted(sizes)
    left.loglog(ss, [sizes[s] * 1e3 for s in ss], "o", color="#4C72B0", label="measured, 2 ranks")
    left.loglog(ss, [ring_model_seconds(FIT_RANKS, s, alpha, beta) * 1e3 for s in ss], "-", color="#4C72B0",
                alpha=0.5, label="model 2(N-1)·α + 2(N-1)/N·S/β")
    left.axvline(crossover_bytes(FIT_RANKS, alpha, beta), ls=":", color="grey", label="crossover S* = N·α·β")
    left.set_xlabel("all-reduce size S (bytes)")
    left.set_ylabel("time (ms)")
    left.set_title(f"fitted: α = {alpha * 1e3:.2f} ms a step, β = {beta / 1e9:.2g} GB/s", fontsize=8)
    left.legend(fontsize=7)
    ns = sorted(sweep)
    cores = cores or machine_cores()
    within = fitted_ranks(ns, cores)   # beyond the cores a rank also waits for a core: not the ring's time
    for key, size, colour in (("small_ring_s", SMALL_BYTES, "#4C72B0"), ("ring_s", payload_bytes, "#DD8452")):
        kib = f"{size / 2**10:.0f} KiB"
        right.plot(within, [sweep[n][key] * 1e3 for n in within], "s", color=colour, ms=7,
                   label=f"{kib}: measured, N ≤ {cores} cores")
        right.plot(ns, [ring_model_seconds(n, size, alpha, beta) * 1e3 for n in ns], "-", color=colour,
                   alpha=0.5, label=f"{kib}: model")
    right.set_xlabel("ranks N")
    right.set_ylabel("time (ms)")
    right.set_title("the model with the same α and β, as N grows", fontsize=8)
    right.set_xticks(ns)
    right.legend(fontsize=6)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return fig


def _save(fig, path):
    save_figure(fig, path, bbox_inches="tight")


def make_collectives(path):
    _save(collectives_figure(), path)


def make_ring_vs_root(path, numel: int = 3 * 2**13):
    _save(plot_traffic(traffic_sweep(numel=numel), numel * 4), path)


FIGURES = {"00_collectives.png": make_collectives, "00_ring_vs_root.png": make_ring_vs_root}

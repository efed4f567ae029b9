"""Appendix A pictures.

* ``A_predicted_vs_measured.png`` — the cost model against tour rows run now: bytes sent per rank and memory,
  predicted / measured (:func:`.bench.compare_with_tour`).
* ``A_step_time_predicted_vs_measured.png`` — the recorded step times (:data:`.recorded.RECORD`) against the
  cost model's two predictions.
"""
from __future__ import annotations

from minipar.course.plotting import save_figure

__all__ = ["draw_predicted_vs_measured", "draw_step_times", "FIGURES"]


def draw_predicted_vs_measured(rows: list, axes=None):
    """Predicted / measured for every row: bytes sent per rank (left) and memory (right, ±10 % shaded)."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 0.4 * len(rows) + 1.5), sharey=True)
    labels = [f"{r.get('name', r['strategy'][:40])} ({r['memory_is']})" for r in rows]
    y = list(range(len(rows)))[::-1]
    for ax, key, title in ((axes[0], "bytes", "bytes sent per rank: predicted / measured"),
                           (axes[1], "memory", "memory: predicted / measured")):
        ratios = [r[f"{key}_predicted"] / r[f"{key}_measured"] if r[f"{key}_measured"] else None for r in rows]
        ax.axvspan(0.9, 1.1, color="0.9")
        ax.axvline(1.0, color="k", lw=0.8)
        shown = [(yy, q) for yy, q in zip(y, ratios) if q is not None]
        ax.barh([yy for yy, _ in shown], [q - 1 for _, q in shown], left=1,
                color=["#4C72B0" if abs(q - 1) <= 0.1 else "#C44E52" for _, q in shown])
        for yy, q in zip(y, ratios):
            ax.text(1.17, yy, "not measured" if q is None else f"{q:.3f}", va="center", fontsize=8)
        ax.set_xlim(0.8, 1.3)
        ax.set_title(title, fontsize=10)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(labels, fontsize=8)
    return axes


def draw_step_times(rows: list, ax=None, title: str | None = None):
    """Log-log scatter of predicted (x) against measured (y) seconds per step, two points per row of
    :func:`.bench.step_times`: compute counted (FLOPs / calibrated FLOP/s; hollow) and compute measured
    with the wire cut (filled, labelled), joined by a line; the line y = x and a band of ±2× around it."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 5))
    ys = [r["measured"] * 1e3 for r in rows]
    counted = [r["predicted"] * 1e3 for r in rows]
    cut = [r["predicted_cut"] * 1e3 for r in rows]
    ends = [s[k] * 1e3 for s in (r.get("measured_spread") for r in rows) if s for k in ("min", "max")]
    lo, hi = min(counted + cut + ys + ends) / 1.6, max(counted + cut + ys + ends) * 1.6
    ax.plot([lo, hi], [lo, hi], color="k", lw=0.8, label="measured = predicted")
    ax.fill_between([lo, hi], [lo / 2, hi / 2], [lo * 2, hi * 2], color="0.92", label="within 2×")
    for a, b, y in zip(counted, cut, ys):
        ax.plot([a, b], [y, y], color="0.6", lw=0.7)
    spreads = [r.get("measured_spread") for r in rows]
    if all(spreads):                 # the measured range over the runs, at the wire-cut prediction
        ax.errorbar(cut, ys, yerr=[[y - s["min"] * 1e3 for y, s in zip(ys, spreads)],
                                   [s["max"] * 1e3 - y for y, s in zip(ys, spreads)]],
                    fmt="none", ecolor="#C44E52", elinewidth=0.8, capsize=2, label="measured [min–max] over runs")
    ax.scatter(counted, ys, facecolors="none", edgecolors="#4C72B0", zorder=3, label="compute counted (FLOPs)")
    ax.scatter(cut, ys, color="#C44E52", zorder=3, label="compute measured (wire cut)")
    for r, x, y in zip(rows, cut, ys):
        ax.annotate(f"{r['name']} ×{y / x:.2f}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted ms per step (estimate, calibrated on this machine)")
    ax.set_ylabel(f"measured ms per step ({rows[0].get('ranks', 4)} ranks; median)")
    ax.set_title(title or "a step (the slowest rank's): measured / predicted", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return ax


def _save(fig, path):
    save_figure(fig, path)


def _measured(path):
    import matplotlib.pyplot as plt
    from .bench import compare_with_tour
    rows = compare_with_tour()
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.4 * len(rows) + 1.5), sharey=True)
    draw_predicted_vs_measured(rows, axes)
    _save(fig, path)


def _step_times(path):
    """The recorded step times (:data:`.recorded.RECORD`, made by ``python -m minipar bench steps``)."""
    import matplotlib.pyplot as plt
    from .recorded import load
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    draw_step_times(load()["step_rows"], ax, title="a step (the slowest rank's): measured / predicted, recorded")
    _save(fig, path)


FIGURES = {"A_predicted_vs_measured.png": _measured, "A_step_time_predicted_vs_measured.png": _step_times}

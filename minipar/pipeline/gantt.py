"""Drawing a schedule: the Gantt chart of a simulated or measured pipeline step.

It draws the same action lists the runtime executes and the simulator times
(:mod:`minipar.pipeline.schedules`), kept here beside them as PyTorch keeps ``_schedule_visualizer.py``
next to its ``schedules.py``. A row is ``(rank, kind, stage, microbatch, start, end)``; ``kind`` is F
(forward), B (backward of the input), W (backward of the weights) or BW (both at once).
"""
from __future__ import annotations

__all__ = ["KIND_COLOURS", "sim_rows", "draw_gantt", "gantt_legend"]

KIND_COLOURS = {"F": "#4C72B0", "BW": "#55A868", "B": "#8CC084", "W": "#DD8452"}


def sim_rows(sim) -> list:
    """[(rank, kind, stage, microbatch, start, end)] of a :class:`SimResult`."""
    return [(r, s.action.kind, s.action.stage, s.action.microbatch, s.start, s.end)
            for r, tl in enumerate(sim.timelines) for s in tl]


def draw_gantt(ax, rows: list, p: int, title: str = "", labels: bool = True, v: int = 1):
    """One bar per action on its rank's line; the micro-batch number inside; later chunks hatched.
    Bars of one rank, kind and chunk parity go into one ``broken_barh`` (fast to draw)."""
    groups: dict = {}
    for rank, kind, stage, mb, start, end in rows:
        groups.setdefault((rank, kind, (stage // p) % 2), []).append((start, end - start))
        if labels and end > start and len(rows) <= 160:
            ax.text((start + end) / 2, rank, str(mb), ha="center", va="center", fontsize=6, color="white")
    for (rank, kind, odd_chunk), spans in groups.items():
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=KIND_COLOURS[kind], edgecolor="white",
                       linewidth=0.5, hatch="//" if odd_chunk else None)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=7)
    ax.set_title(title, fontsize=9, loc="left")
    ax.tick_params(axis="x", labelsize=7)
    ax.autoscale(axis="x")


def gantt_legend(fig):
    """One legend for a figure of Gantt charts: a colour per action kind, hatching for the second chunk."""
    from matplotlib.patches import Patch
    handles = [Patch(color=c, label=k) for k, c in KIND_COLOURS.items()]
    handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label="chunk 1 (interleaved)"))
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=7, frameon=False)

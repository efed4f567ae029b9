"""Drawing a timeline: the Gantt chart of a simulated, measured or replayed step — one drawing, several sources.

It draws the same action lists the runtime executes and the simulator times
(:mod:`minipar.pipeline.schedules`), kept here beside them as PyTorch keeps ``_schedule_visualizer.py``
next to its ``schedules.py``. A row is ``(rank, kind, stage, microbatch, start, end)``; ``kind`` is F
(forward), B (backward of the input), W (backward of the weights) or BW (both at once) for a pipeline
(:func:`sim_rows`, paced and measured runs), and for a replay of a trace on a declared cluster
(:func:`replay_rows` of a :class:`minipar.machine.replay.ReplayResult`) "compute", "comm hidden" (a transfer while
the rank computes), "comm exposed" (a transfer while it does not) and "idle" (neither): compute in the upper
half of a rank's line, its transfers in the lower half, so that a hidden transfer sits under compute.
"""
from __future__ import annotations

__all__ = ["KIND_COLOURS", "REPLAY_KINDS", "sim_rows", "replay_rows", "draw_gantt", "gantt_legend"]

KIND_COLOURS = {"F": "#4C72B0", "BW": "#55A868", "B": "#8CC084", "W": "#DD8452",
                "compute": "#4C72B0", "comm hidden": "#8CC084", "comm exposed": "#C44E52", "idle": "#D9D9D9"}
REPLAY_KINDS = ("compute", "comm hidden", "comm exposed", "idle")
# (offset from the rank's line, height) of a bar; pipeline actions fill the line
_BANDS = {"compute": (-0.4, 0.4), "idle": (-0.4, 0.4), "comm hidden": (0.0, 0.4), "comm exposed": (0.0, 0.4)}


def sim_rows(sim) -> list:
    """[(rank, kind, stage, microbatch, start, end)] of a :class:`SimResult`."""
    return [(r, s.action.kind, s.action.stage, s.action.microbatch, s.start, s.end)
            for r, tl in enumerate(sim.timelines) for s in tl]


def replay_rows(result, start: float = 0.0, end: float | None = None) -> list:
    """[(rank, kind, 0, 0, start, end)] of a :class:`minipar.machine.replay.ReplayResult` between ``start`` and
    ``end`` (default: the whole replay), shifted so that ``start`` is 0: each rank's
    :meth:`~minipar.machine.replay.ReplayResult.pieces` — compute; its transfers under its own compute ("comm
    hidden") and not ("comm exposed"); "idle" where it neither computes nor transfers — the intervals whose
    lengths are the replay's compute / hidden / exposed / idle."""
    return [(rank, kind, 0, 0, a - start, b - start) for rank in range(len(result.timelines))
            for kind, got in result.pieces(rank, start, end).items() for a, b in got]


def draw_gantt(ax, rows: list, p: int, title: str = "", labels: bool = True, v: int = 1):
    """One bar per action on its rank's line; the micro-batch number inside; later chunks hatched.
    Bars of one rank, kind and chunk parity go into one ``broken_barh`` (fast to draw)."""
    groups: dict = {}
    for rank, kind, stage, mb, start, end in rows:
        groups.setdefault((rank, kind, (stage // p) % 2), []).append((start, end - start))
        if labels and end > start and len(rows) <= 160 and kind not in _BANDS:
            ax.text((start + end) / 2, rank, str(mb), ha="center", va="center", fontsize=6, color="white")
    for (rank, kind, odd_chunk), spans in groups.items():
        offset, height = _BANDS.get(kind, (-0.4, 0.8))
        ax.broken_barh(spans, (rank + offset, height), facecolors=KIND_COLOURS[kind],
                       edgecolor="white" if kind not in _BANDS else "none", linewidth=0.5,
                       hatch="//" if odd_chunk else None)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=7)
    ax.set_title(title, fontsize=9, loc="left")
    ax.tick_params(axis="x", labelsize=7)
    ax.autoscale(axis="x")


def gantt_legend(fig, kinds=("F", "BW", "B", "W")):
    """One legend for a figure of Gantt charts: a colour per kind drawn (the pipeline's actions by default,
    with hatching for the second chunk; :data:`REPLAY_KINDS` for replays)."""
    from matplotlib.patches import Patch
    handles = [Patch(color=KIND_COLOURS[k], label=k) for k in kinds]
    if any(k not in _BANDS for k in kinds):
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label="chunk 1 (interleaved)"))
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=7, frameon=False)

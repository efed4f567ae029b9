"""Chapter 08 pictures.

* ``08_mesh_groups.png`` — the 8 ranks of a dp 2 × pp 2 × tp 2 mesh, drawn as two nodes of four, with each
  rank's tp, pp and dp group as coloured links (from :meth:`minipar.mesh.Mesh.groups`).
* ``08_step_timeline.png`` — one real step of the tiny GPT at 2×2×2 (1F1B, m = 4) on all 8 ranks: each rank's
  F and BW spans from its pipeline timeline (the typical step of 3).
* ``08_memory_per_layout.png`` — the same model under each layout of the chapter, on 8 ranks: measured peak
  bytes per rank (max over ranks; model states + what a step allocates) and the model states alone.
"""
from __future__ import annotations

__all__ = ["draw_mesh", "draw_step", "draw_memory", "FIGURES"]

COLOURS = {"tp": "tab:red", "pp": "tab:blue", "dp": "tab:green"}


def _position(rank: int, mesh) -> tuple:
    c = mesh.coords(rank)
    return 3.2 * c["dp"] + 1.2 * c["tp"], -1.2 * c["pp"]        # a node per dp replica, as in the Hugging Face guide


def draw_mesh(ax, dp: int = 2, pp: int = 2, tp: int = 2):
    """Ranks as dots (grouped by node = one dp replica), links for every group, coloured by dimension."""
    from minipar.mesh import Mesh
    mesh = Mesh(dp * pp * tp, dp=dp, pp=pp, tp=tp)
    for dim, bend in (("dp", 0.35), ("pp", 0.0), ("tp", 0.0)):
        for ranks in mesh.groups(dim):
            for a, b in zip(ranks, ranks[1:]):
                (x0, y0), (x1, y1) = _position(a, mesh), _position(b, mesh)
                ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="-", color=COLOURS[dim], lw=2.5,
                                                                      connectionstyle=f"arc3,rad={bend}"))
    for rank in range(mesh.world_size):
        x, y = _position(rank, mesh)
        ax.scatter([x], [y], s=500, color="white", edgecolor="black", zorder=3)
        ax.text(x, y, str(rank), ha="center", va="center", fontsize=9, zorder=4)
    for d in range(dp):
        x0 = 3.2 * d - 0.5
        ax.add_patch(__import__("matplotlib").patches.FancyBboxPatch(
            (x0, -1.2 * (pp - 1) - 0.5), 1.2 * (tp - 1) + 1.0, 1.2 * (pp - 1) + 1.0, boxstyle="round,pad=0.05",
            fill=False, linestyle="--", edgecolor="grey"))
        ax.text(x0, 0.65, f"node {d} (dp replica {d})", fontsize=8, color="grey")
    for dim, colour in COLOURS.items():
        ax.plot([], [], color=colour, lw=2.5, label=f"{dim} group")
    ax.legend(loc="lower center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, -0.18), frameon=False)
    ax.set_title(f"dp {dp} × pp {pp} × tp {tp}: tp inside a node (talks every layer), pp down a node, "
                 f"dp across nodes (once a step)", fontsize=9)
    ax.set_axis_off()
    ax.set_aspect("equal")
    ax.set_ylim(-1.2 * (pp - 1) - 1.0, 1.0)


def draw_step(ax, runs, step: int | None = None):
    """Every rank's F/BW spans in one step of a real run (``runs``: per-rank HybridRuns)."""
    from minipar.pipeline.gantt import draw_gantt
    from minipar.pipeline.timeline import step_rows, typical_step
    step = typical_step(runs) if step is None else step
    rows = step_rows(runs, step)
    labels = [f"rank {r} (dp{c['dp']} pp{c['pp']} tp{c['tp']})" for r, c in enumerate(x.coords for x in runs)]
    draw_gantt(ax, rows, len(runs), f"one step at 2×2×2, 1F1B, m = 4 (measured, step {step + 1} of {len({row[0] for row in runs[0].timeline})}); "
               f"the number in a bar: its micro-batch")
    ax.set_yticks(range(len(runs)), labels, fontsize=7)
    ax.set_xlabel("seconds since the step's first action", fontsize=8)
    from matplotlib.patches import Patch
    from minipar.pipeline.gantt import KIND_COLOURS
    ax.legend(handles=[Patch(color=KIND_COLOURS["F"], label="F: forward of a micro-batch"),
                       Patch(color=KIND_COLOURS["BW"], label="BW: its backward (input and weights)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7, frameon=False)


def draw_memory(ax, measured: dict):
    """``measured``: {layout name: (peak bytes, model-state bytes)} per rank (max over ranks)."""
    names = list(measured)
    peaks = [measured[n][0] / 1024 for n in names]
    states = [measured[n][1] / 1024 for n in names]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], peaks, width=0.4, label="peak during a step (measured)", color="tab:blue")
    ax.bar([x + 0.2 for x in xs], states, width=0.4, label="model states (params + grads + Adam)", color="tab:grey")
    ax.set_xticks(list(xs), names, rotation=20, fontsize=7, ha="right")
    ax.set_ylabel("KiB per rank (max over ranks)", fontsize=8)
    ax.legend(fontsize=7)
    ax.set_title("the same tiny GPT under each layout, 8 ranks (float64)", fontsize=9)


def _mesh_figure(path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    draw_mesh(ax)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _step_figure(path):
    import matplotlib.pyplot as plt
    from minipar.hybrid.runner import run
    from .measure import recipe
    runs = run(recipe(3), world_size=8, dp=2, pp=2, tp=2, micro_batches=4)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    draw_step(ax, runs)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def memory_by_layout(steps: int = 2) -> dict:
    """{layout: (peak, model states)} per rank, max over the 8 ranks, from real runs."""
    from minipar.hybrid.runner import run
    from .measure import LAYOUTS, recipe
    out = {}
    for name, layout in LAYOUTS.items():
        runs = run(recipe(steps), world_size=8, micro_batches=4, track_memory=True, **layout)
        out[name] = (max(r.peak_bytes for r in runs), max(r.model_state_bytes for r in runs))
    return out


def _memory_figure(path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.4))
    draw_memory(ax, memory_by_layout())
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


FIGURES = {"08_mesh_groups.png": _mesh_figure, "08_step_timeline.png": _step_figure,
           "08_memory_per_layout.png": _memory_figure}

"""Chapter 09b pictures.

* ``09b_mesh_5d.png`` — 16 ranks of dp 2 × pp 2 × cp 2 × tp 2 on two nodes of 8: the dense groups (tp boxed,
  cp partners, the next stage, one rank's dp × cp group), and beside it the ep groups folded over a stage's
  dp × cp × tp ranks with one rank's expert-DP group.
* :func:`draw_replayed_step` — one replayed 16-rank step, compute and calls by mesh dimension.
"""
from __future__ import annotations

__all__ = ["draw_mesh_5d", "draw_replayed_step", "FIGURES"]


COLOURS_5D = {"tp": "tab:red", "cp": "tab:orange", "pp": "tab:blue", "dp": "tab:green", "ep": "tab:purple",
              "expert_dp": "tab:purple"}


def _position_5d(rank: int, mesh) -> tuple:
    c = mesh.coords(rank)                       # a node per dp coordinate; pp down; cp blocks of tp pairs across
    return 5.0 * c["dp"] + 2.0 * c["cp"] + 0.9 * c["tp"], -1.5 * c["pp"]


def _box(ax, ranks, mesh, colour, pad=0.38, style="-", lw=1.8, fill=None):
    from matplotlib.patches import FancyBboxPatch
    xs, ys = zip(*(_position_5d(r, mesh) for r in ranks))
    ax.add_patch(FancyBboxPatch((min(xs) - pad, min(ys) - pad), max(xs) - min(xs) + 2 * pad, max(ys) - min(ys) + 2 * pad,
                                boxstyle="round,pad=0.02", fill=fill is not None, facecolor=fill or "none",
                                edgecolor=colour, linestyle=style, lw=lw, zorder=1))


def draw_mesh_5d(ax, dp: int = 2, pp: int = 2, cp: int = 2, tp: int = 2, ep: int | None = None,
                 devices_per_node: int = 8, example: int = 0):
    """The ranks of ``Mesh(dp·pp·cp·tp, dp=, pp=, cp=, tp=)``, a grey box per node of ``devices_per_node``, a row
    per pipeline stage. ``ep=None``: every tp group boxed (red), cp partners joined (orange), stages joined (blue),
    and one example of the group that crosses the nodes: rank ``example``'s dp × cp group (green). ``ep`` given:
    the ep groups of :func:`five_d.reduction_groups` boxed (purple) and rank ``example``'s expert-DP group
    (dashed purple). Only the example's cross-node links are drawn: every other group is its translate."""
    from minipar.mesh import Mesh
    from .five_d import reduction_groups
    world = dp * pp * cp * tp
    mesh = Mesh(world, dp=dp, pp=pp, cp=cp, tp=tp, devices_per_node=devices_per_node)
    for node in range(-(-world // devices_per_node)):
        _box(ax, [r for r in range(world) if mesh.node_of(r) == node], mesh, "grey", pad=0.6, style="--", lw=1)
        x0 = min(_position_5d(r, mesh)[0] for r in range(world) if mesh.node_of(r) == node)
        ax.text(x0 - 0.6, 0.75, f"node {node}", fontsize=8, color="grey")
    for stage in range(pp):
        ax.text(-1.1, -1.5 * stage, f"stage {stage}", fontsize=7, color="tab:blue", ha="right", va="center")

    def join(a, b, colour, bend=0.0, style="-", lw=1.8):
        (x0, y0), (x1, y1) = _position_5d(a, mesh), _position_5d(b, mesh)
        ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="-", color=colour, lw=lw, linestyle=style,
                                                              connectionstyle=f"arc3,rad={bend}"), zorder=2)
    if ep:
        groups = reduction_groups(world, dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
        for ranks in groups["ep"]:
            _box(ax, ranks, mesh, COLOURS_5D["ep"])
        chosen = next(g for g in groups["expert_dp"] if example in g)
        for a, b in zip(chosen, chosen[1:]):
            join(a, b, COLOURS_5D["expert_dp"], -0.25, "--", 2.0)
        handles = [("ep group (boxed): all-to-all of tokens", COLOURS_5D["ep"], "-"),
                   (f"rank {example}'s expert-DP group (shaded): its experts' gradients", COLOURS_5D["expert_dp"], "--")]
        shade = "#d9c2ea"
        what = f"experts: ep {ep} folded over each stage's dp × cp × tp ranks; expert-DP {dp * cp * tp // ep}"
    else:
        for ranks in mesh.groups("tp"):
            _box(ax, ranks, mesh, COLOURS_5D["tp"])
        for dim in ("cp", "pp"):
            for ranks in mesh.groups(dim):
                if all(mesh.coords(r)["tp"] == 0 for r in ranks):      # one line per pair of tp boxes
                    for a, b in zip(ranks, ranks[1:]):
                        join(a, b, COLOURS_5D[dim], -0.45 if dim == "cp" else 0.0)
        chosen = mesh.group_ranks(("dp", "cp"), example)
        for a in chosen:                                   # its dp links: the ones that cross the nodes
            b = next((b for b in chosen if mesh.node_of(b) != mesh.node_of(a) and b > a
                      and mesh.coords(b)["cp"] == mesh.coords(a)["cp"]), None)
            if b is not None:
                join(a, b, COLOURS_5D["dp"], -0.25, "-", 2.2)
        handles = [("tp group (boxed)", COLOURS_5D["tp"], "-"), ("cp partners", COLOURS_5D["cp"], "-"),
                   ("pp: next stage", COLOURS_5D["pp"], "-"),
                   (f"rank {example}'s dp × cp group (shaded): gradients", COLOURS_5D["dp"], "-")]
        shade = "#d8f0d8"
        what = f"dense: dp {dp} × pp {pp} × cp {cp} × tp {tp}, a node per dp replica"
    for rank in range(world):
        x, y = _position_5d(rank, mesh)
        ax.scatter([x], [y], s=260, color=shade if rank in chosen else "white", edgecolor="black", zorder=3)
        ax.text(x, y, str(rank), ha="center", va="center", fontsize=7, zorder=4)
    for label, colour, style in handles:
        ax.plot([], [], color=colour, lw=2.2, linestyle=style, label=label)
    ax.legend(loc="upper center", ncol=2, fontsize=7, bbox_to_anchor=(0.5, 0.0), frameon=False)
    ax.set_title(what, fontsize=8)
    ax.set_axis_off()
    ax.set_aspect("equal")
    ax.set_xlim(-2.6, 5.0 * (dp - 1) + 2.0 * (cp - 1) + 0.9 * (tp - 1) + 0.8)
    ax.set_ylim(-1.5 * (pp - 1) - 0.9, 1.1)


def _mesh_5d_figure(path):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    draw_mesh_5d(axes[0])
    draw_mesh_5d(axes[1], ep=2)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def draw_replayed_step(ax, replayed, trace, mesh, step: int = 1):
    """Each rank's spans between its ``step``-th and next "step" mark of a :func:`minipar.machine.replay.replay`:
    compute grey, a call coloured by the mesh dimensions its group spans (dp × cp = the gradients)."""
    starts = [marks[step - 1][1] for marks in replayed.marks]
    ends = [marks[step][1] for marks in replayed.marks]
    t0, t1 = min(starts), max(ends)
    bars: dict = {}
    for rank, spans in enumerate(replayed.timelines):
        for s in spans:
            if s.end < t0 or s.start > t1 or s.end <= s.start:
                continue
            if s.kind == "compute":
                key = "compute"
            else:
                dims = mesh.dims_spanned(trace.ranks[rank].events[s.index].ranks)
                key = "dp × cp" if set(dims) >= {"dp"} else " × ".join(dims)
            bars.setdefault(key, {}).setdefault(rank, []).append(((s.start - t0) * 1e3, (s.end - s.start) * 1e3))
    colours = {"compute": "lightgrey", "tp": "tab:red", "cp": "tab:orange", "pp": "tab:blue", "dp × cp": "tab:green"}
    for key, per_rank in bars.items():
        for rank, spans in per_rank.items():
            ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=colours.get(key, "black"), linewidth=0)
        ax.plot([], [], color=colours.get(key, "black"), lw=6, label=key)
    labels = [f"{r} " + " ".join(f"{d}{c}" for d, c in mesh.coords(r).items() if mesh.sizes[d] > 1)
              for r in range(mesh.world_size)]
    ax.set_yticks(range(mesh.world_size), labels, fontsize=6)
    ax.set_ylim(mesh.world_size - 0.5, -0.5)
    ax.set_xlabel("ms (replayed)", fontsize=8)
    ax.legend(fontsize=7, ncol=6, loc="lower center", bbox_to_anchor=(0.5, -0.3), frameon=False)


FIGURES = {"09b_mesh_5d.png": _mesh_5d_figure}

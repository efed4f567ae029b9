"""Chapter 04b pictures, drawn from the schedules' action lists.

* ``04b_v_schedules.png`` — the V placement (rank r holds stages r and 2p-1-r: down the ranks and back up),
  and simulated Gantt charts of 1F1B, ZB-H1, ZB-V and DualPipeV on 4 ranks, m = 8 (F = B = W per stage).
  Simulated only, so the same every time it is drawn.
"""
from __future__ import annotations

from minipar.course.plotting import save_figure
from minipar.pipeline.gantt import draw_gantt, gantt_legend, sim_rows
from minipar.pipeline.schedules import make_schedule
from minipar.pipeline.simulate import simulate

__all__ = ["V_SHOWN", "draw_v_schedules", "FIGURES"]

V_SHOWN = [("1f1b", 8, 1), ("zb-h1", 8, 1), ("zb-v", 8, 2), ("dualpipev", 8, 2)]


def draw_v_schedules(p: int = 4, shown=V_SHOWN):
    """Left: which rank holds each stage in the V (ZB-V, DualPipeV) and round-robin (interleaved v = 2).
    Right: simulated Gantt charts of ``shown``, with bubble and peak activations (in whole stages)."""
    import matplotlib.pyplot as plt
    fig = plt.figure(figsize=(11, 1.3 * len(shown) + 0.8))
    grid = fig.add_gridspec(len(shown), 2, width_ratios=[1, 3])
    ax = fig.add_subplot(grid[:, 0])
    for name, v, style in (("zb-v", 2, "o-"), ("interleaved", 2, "s--")):
        sched = make_schedule(name, p, 2 * p, v)
        stages = range(sched.num_stages)
        ax.plot(list(stages), [sched.rank_of(x) for x in stages], style, label=f"{sched.placement} ({name})")
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=7)
    ax.set_xlabel("stage (input → loss)", fontsize=8)
    ax.set_title("where each stage lives", fontsize=9, loc="left")
    ax.legend(fontsize=7, loc="lower center")
    axes = [fig.add_subplot(grid[0, 1])]
    axes += [fig.add_subplot(grid[i, 1], sharex=axes[0]) for i in range(1, len(shown))]   # one time axis
    for a, (name, m, v) in zip(axes, shown):
        sim = simulate(make_schedule(name, p, m, v))
        draw_gantt(a, sim_rows(sim), p, f"{name}  p={p} m={m}:  bubble {sim.bubble_fraction:.1%}, peak "
                                        f"activations {max(sim.peak_activations):g} stages, "
                                        f"{sim.p2p_messages} messages")
    axes[-1].set_xlabel("time (F = B = W = 1 per stage; a V chunk is half a stage)", fontsize=8)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.94, bottom=0.14, hspace=0.7, wspace=0.15)
    gantt_legend(fig)
    return fig


FIGURES = {
    "04b_v_schedules.png": lambda path: save_figure(draw_v_schedules(), path),
}

"""Chapter 04 pictures, drawn from the schedules' action lists and from real runs' timelines.

* ``04_schedules.png`` — Gantt charts of naive, GPipe, 1F1B, interleaved (v = 2) and ZB-H1 on 4 ranks,
  simulated from the action lists (F = B = W = 1), with the bubble fraction of each.
* ``04_measured_timelines.png`` — the same schedules run for real on 4 CPU ranks (tiny GPT, m = 8): each
  rank's recorded F/B/W/BW spans in a typical step (median length of 3), black lines where it waited in a
  receive, with the measured idle fraction next to the simulated one.
* ``04_activation_memory.png`` — live bytes per rank over a step (4-block GPT, m = 8), measured with
  :class:`minipar.memory.LiveTensorTracker`: GPipe vs 1F1B, with and without recomputation. The floor is
  what a step allocates besides activations (parameter gradients, receive buffers).
"""
from __future__ import annotations

from minipar.check import gpt_recipe
from minipar.pipeline import runtime
from minipar.pipeline.runtime import measured_idle_fraction, step_rows, typical_step
from minipar.pipeline.schedules import make_schedule
from minipar.pipeline.gantt import KIND_COLOURS, draw_gantt, gantt_legend, sim_rows
from minipar.pipeline.simulate import Costs, simulate

__all__ = ["KIND_COLOURS", "sim_rows", "draw_gantt", "draw_schedules", "timeline_recipe", "run_timelines",
           "draw_measured", "memory_runs", "draw_memory", "FIGURES"]

SHOWN = [("naive", 1, 1), ("gpipe", 8, 1), ("1f1b", 8, 1), ("interleaved", 8, 2), ("zb-h1", 8, 1)]


def draw_schedules(p: int = 4, costs: Costs = Costs(), shown=SHOWN):
    """Simulated Gantt charts of every schedule (a matplotlib Figure)."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 1.3 * len(shown) + 0.6), sharex=True)
    for ax, (name, m, v) in zip(axes, shown):
        sim = simulate(make_schedule(name, p, m, v), costs)
        draw_gantt(ax, sim_rows(sim), p, f"{name}  p={p} m={m}{f' v={v}' if v > 1 else ''}:  "
                                         f"bubble {sim.bubble_fraction:.1%}")
    axes[-1].set_xlabel("time (F = 1, B = W = 1, BW = 2)", fontsize=8)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.95, bottom=0.12, hspace=0.6)
    gantt_legend(fig)
    return fig


def timeline_recipe(n_layer: int = 8, steps: int = 4):
    """The runs behind the measured charts: tiny GPT, hidden 32, sequence 8, global batch 16 (the step of
    median length is drawn, see :func:`minipar.pipeline.runtime.typical_step`)."""
    return gpt_recipe(steps=steps, batch_size=16, seq_len=8, n_layer=n_layer, n_embd=32, n_head=2)


def run_timelines(p: int = 4, shown=SHOWN[1:]) -> dict:
    """{(name, m, v): per-rank PipelineRuns} of real runs on ``p`` ranks."""
    recipe = timeline_recipe()
    return {(name, m, v): runtime.run(recipe, world_size=p, schedule=name, m=m, v=v) for name, m, v in shown}


def draw_measured(runs_by_schedule: dict, p: int = 4):
    """Simulated (left) and measured (right) Gantt charts, with both idle fractions."""
    import matplotlib.pyplot as plt
    n = len(runs_by_schedule)
    fig, axes = plt.subplots(n, 2, figsize=(12, 1.4 * n + 0.6))
    for (name, m, v), ax_row in zip(runs_by_schedule, axes):
        runs = runs_by_schedule[(name, m, v)]
        sim = simulate(make_schedule(name, p, m, v))
        draw_gantt(ax_row[0], sim_rows(sim), p, f"{name} simulated: idle {sim.bubble_fraction:.1%}")
        step = typical_step(runs)
        rows = [(r, k, s, i, 1e3 * a, 1e3 * b) for r, k, s, i, a, b in step_rows(runs, step)]
        draw_gantt(ax_row[1], rows, p, f"{name} measured (step {step}): idle "
                                       f"{measured_idle_fraction(runs, step):.1%}", labels=False)
        for rank, _, _, _, a, b in step_rows(runs, step, kinds=("wait",)):   # blocked in a receive
            ax_row[1].plot([1e3 * a, 1e3 * b], [rank, rank], color="black", linewidth=1.2)
    axes[-1][0].set_xlabel("simulated time (F = 1)", fontsize=8)
    axes[-1][1].set_xlabel("measured ms (4 CPU processes, gloo)", fontsize=8)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.94, bottom=0.12, hspace=0.7, wspace=0.12)
    gantt_legend(fig)
    return fig


def memory_runs(p: int = 4, m: int = 8) -> dict:
    """{(schedule, recompute): per-rank PipelineRuns with live-byte samples after every action}."""
    recipe = timeline_recipe(n_layer=4, steps=1)          # live bytes do not depend on warm-up
    return {(s, rc): runtime.run(recipe, world_size=p, schedule=s, m=m, recompute=rc, track_memory=True)
            for s in ("gpipe", "1f1b") for rc in (False, True)}


def draw_memory(runs_by_config: dict, p: int = 4):
    """Live bytes on each rank over the last step, one line per configuration."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, p, figsize=(3 * p, 2.8), sharey=True)
    styles = {("gpipe", False): "C3-", ("1f1b", False): "C0-", ("gpipe", True): "C3:", ("1f1b", True): "C0:"}
    for (sched, rc), runs in runs_by_config.items():
        last = max(row[0] for row in runs[0].memory)
        for rank, run in enumerate(runs):
            samples = [(t, b) for st, t, b in run.memory if st == last]
            t0, t1 = samples[0][0], samples[-1][0]
            axes[rank].plot([(t - t0) / (t1 - t0) for t, _ in samples], [b / 1024 for _, b in samples],
                            styles[(sched, rc)], label=f"{sched}{' + recompute' if rc else ''}")
    for rank, ax in enumerate(axes):
        ax.set_title(f"rank {rank} (stage {rank})", fontsize=9)
        ax.set_xlabel("fraction of the step", fontsize=8)
    axes[0].set_ylabel("live KiB (measured)", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.88, bottom=0.18, wspace=0.08)
    return fig


def _save(fig, path):
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)


FIGURES = {
    "04_schedules.png": lambda path: _save(draw_schedules(), path),
    "04_measured_timelines.png": lambda path: _save(draw_measured(run_timelines()), path),
    "04_activation_memory.png": lambda path: _save(draw_memory(memory_runs()), path),
}

"""Chapter 04 pictures, drawn from the schedules' action lists and from real runs' timelines.

* ``04_schedules.png`` — Gantt charts of naive, GPipe, 1F1B, interleaved (v = 2) and ZB-H1 on 4 ranks,
  simulated from the action lists (F = B = W = 1), with the bubble fraction of each.
* ``04_measured_timelines.png`` — the same schedules run for real on 4 CPU ranks (tiny GPT, m = 8), *paced*
  (:mod:`minipar.pipeline.paced`: every action held to a fixed 20 ms slot, F = B = W as in the simulated
  charts): each rank's recorded F/B/W/BW spans in the last step, with the measured idle fraction next to
  the simulated one (unpaced runs, drawn by the same function, add black lines where a rank waited in a
  receive; a paced receive waits inside its slot).
* (notebook only) :func:`draw_weight_versions` — the weight version every stage used for each micro-batch's
  forward and backward, asynchronous PipeDream (weight stashing) beside PipeDream-2BW.
* ``04_activation_memory.png`` — live bytes per rank over a step (4-block GPT, m = 8, paced the same way),
  measured with :class:`minipar.memory.LiveTensorTracker`: GPipe vs 1F1B, with and without recomputation.
  The floor is what a step allocates besides activations (parameter gradients, receive buffers).

Reproducible, mostly: the measured charts are paced, so an action starts and ends on its slot's
boundaries, late by a wake-up and the posting of its sends (0.5-3 ms on this machine); the last step is
drawn, its times snapped to a quarter-slot grid (:data:`GRID`, in
:func:`minipar.course.pipeline_views.draw_measured`). What still varies, so that ``make figures`` rewrites
a PNG: an action more than 3.75 ms late (an overrun: a rank descheduled by other load for longer than its
slot's slack — at load averages of 8-25 on 2 cores we saw 10-25 % of the actions overrun 20 ms slots, and the timeline chart then changed from run to run), and in the memory chart the
send buffers still in flight when a sample is taken (whether a send has completed is timing) and the
sample times (rounded to 1 % of the step); and the idle fraction in each measured chart's title, which is the
run's wall clock (the number the chapter's table prints for the same run), not the snapped bars'. The unpaced timelines, which do vary
from run to run, are shown only in the notebook.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from minipar.check import compare, gpt_recipe, train_reference
from minipar.course.pipeline_views import GRID, draw_measured, run_together
from minipar.course.plotting import save_figure
from minipar.observe.busy import OtherWork, disturbed, too_busy
from minipar.pipeline import runtime
from minipar.pipeline.paced import Pace
from minipar.pipeline.schedules import make_schedule
from minipar.pipeline.timeline import measured_idle_fraction, typical_step
from minipar.pipeline.gantt import KIND_COLOURS, draw_gantt, gantt_legend, sim_rows
from minipar.pipeline.simulate import Costs, simulate

__all__ = ["schedule_or_error", "schedule_explorer", "KIND_COLOURS", "sim_rows", "draw_gantt", "draw_schedules", "timeline_recipe", "run_timelines",
           "draw_measured", "memory_runs", "draw_memory", "draw_weight_versions", "peak_held", "PacedIdle",
           "paced_idle", "paced_runs", "PacedRuns", "FIGURES", "FIXED_PACE", "GRID"]

FIXED_PACE = Pace(F=0.02, B=0.02, W=0.02)   # the simulated charts' F = B = W (BW = 2 F), 20 ms each

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
    median length is drawn, see :func:`minipar.pipeline.timeline.typical_step`)."""
    return gpt_recipe(steps=steps, batch_size=16, seq_len=8, n_layer=n_layer, n_embd=32, n_head=2)


def run_timelines(p: int = 4, shown=SHOWN[1:], pace=FIXED_PACE) -> dict:
    """{(name, m, v): per-rank PipelineRuns} of real runs on ``p`` ranks (paced unless ``pace=None``)."""
    recipe = timeline_recipe()
    return {(name, m, v): runtime.run(recipe, world_size=p, schedule=name, m=m, v=v, pace=pace)
            for name, m, v in shown}


def memory_runs(p: int = 4, m: int = 8, pace=FIXED_PACE) -> dict:
    """{(schedule, recompute): per-rank PipelineRuns with live-byte samples after every action}."""
    recipe = timeline_recipe(n_layer=4, steps=1)          # live bytes do not depend on warm-up
    return {(s, rc): runtime.run(recipe, world_size=p, schedule=s, m=m, recompute=rc, track_memory=True,
                                 pace=pace) for s in ("gpipe", "1f1b") for rc in (False, True)}


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
            axes[rank].plot([round((t - t0) / (t1 - t0), 2) for t, _ in samples], [b / 1024 for _, b in samples],
                            styles[(sched, rc)], label=f"{sched}{' + recompute' if rc else ''}")
    for rank, ax in enumerate(axes):
        ax.set_title(f"rank {rank} (stage {rank})", fontsize=9)
        ax.set_xlabel("fraction of the step", fontsize=8)
    axes[0].set_ylabel("live KiB (measured)", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.88, bottom=0.18, wspace=0.08)
    return fig


def draw_weight_versions(runs_by_mode: dict, p: int = 4):
    """Which weight version each stage used, per micro-batch, for its forward (light) and backward (dark):
    one panel per PipeDream mode. The versions are the ones the runs recorded
    (:attr:`~minipar.pipeline.pipedream.PipeDreamRun.versions_used`); the bars stand where the 1F1B stream of
    all micro-batches puts them on the simulator's clock (F = 1, BW = 2), so the picture is the same every
    run. A bar reads ``j:w`` — micro-batch j, weight version w; the colour is the version."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs_by_mode), 1, figsize=(12, 1.6 * len(runs_by_mode) + 0.8), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, (title, runs) in zip(axes[:, 0], runs_by_mode.items()):
        used = {(k, s, j): v for run in runs for k, s, j, v in run.versions_used}
        n = 1 + max(j for _, _, j in used)
        sim = simulate(make_schedule("1f1b", p, n))
        for rank, kind, stage, j, a, b in sim_rows(sim):
            version = used[(kind, stage, j)]
            ax.broken_barh([(a, b - a)], (rank - 0.4, 0.8), facecolors=cmap(version % 10),
                           alpha=0.5 if kind == "F" else 1.0, edgecolor="white", linewidth=0.5)
            ax.text((a + b) / 2, rank, f"{j}:{version}", ha="center", va="center", fontsize=5.5)
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_yticks(range(p), [f"stage {r}" for r in range(p)], fontsize=7)
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("the 1F1B stream's clock (simulated, F = 1, BW = 2); light: forward, dark: backward; "
                           "label micro-batch:version (recorded by the run)", fontsize=8)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.9, bottom=0.16, hspace=0.7)
    return fig


def peak_held(run, step: int = -1) -> int:
    """The most micro-batches one rank of a real run held at once in ``step``: counted from the actions it
    recorded (+1 when a forward ends, -1 when its BW or W ends), i.e. the activations kept for a backward."""
    step = step if step >= 0 else max(row[0] for row in run.timeline)
    events = sorted((end, +1 if kind == "F" else -1) for st, kind, _, _, _, end in run.timeline
                    if st == step and kind in ("F", "BW", "W"))
    held = peak = 0
    for _, d in events:
        held += d
        peak = max(peak, held)
    return peak


@dataclass
class PacedIdle:
    """Per schedule: the simulated idle fraction (with the slots' costs), the paced run's measured idle, and how
    many of the paced actions overran their slots."""
    rows: dict                  # {name: (simulated, paced, overruns, actions)}
    slot: float                 # seconds of one F slot
    load: float = 0.0           # the machine's 1-minute load average when the runs ended
    cores: int = 1
    other: float | None = None  # other processes' CPU while the runs ran, in cores (OtherWork); None: unmeasured

    @property
    def disturbed(self) -> list:
        """Schedules whose paced run the shared rule (:func:`minipar.observe.busy.disturbed`, as chapters 02 and 03)
        calls disturbed: more than 5 % of its actions overran, or other processes had the cores while it ran (over a
        quarter of a core; the load average where that was not measured): the timeline is no longer the schedule's."""
        return [n for n, (*_, overruns, actions) in self.rows.items()
                if disturbed(overruns, actions, self.load, self.cores, other=self.other)]

    def agrees(self, within: float = 0.05) -> bool:
        """Every undisturbed paced run idles as its simulation says, within ``within``."""
        return all(abs(paced - sim) < within for n, (sim, paced, _, _) in self.rows.items()
                   if n not in self.disturbed)

    def __str__(self) -> str:
        out = [f"{'':11s}  simulated   paced ({1e3 * self.slot:.0f} ms slots)"]
        out += [f"{n:11s}  {sim:9.1%}   {paced:9.1%}" + (f"   ({o} of {a} actions overran their slots)" if o else "")
                for n, (sim, paced, o, a) in self.rows.items()]     # an overrun is shown only where there is one
        out.append(f"slots that ran long: {sum(o for *_, o, _ in self.rows.values())} of "
                   f"{sum(a for *_, a in self.rows.values())}")
        busy = too_busy(0, 1, self.load, self.cores, other=self.other)   # other work: it disturbs every schedule
        if busy:
            return "\n".join(out + [f"  every schedule: {busy}"])
        out += [f"  {n}: {too_busy(o, a, self.load, self.cores, other=self.other)}" for n, (*_, o, a) in self.rows.items()
                if n in self.disturbed]
        return "\n".join(out)


def paced_idle(paced: dict, p: int = 4) -> PacedIdle:
    """:class:`PacedIdle` of paced runs ``{(name, m, v): runs}`` (a :class:`PacedRuns`: with the other processes' CPU
    while they ran)."""
    rows = {}
    for (n, m, v), rs in paced.items():
        sim = simulate(make_schedule(n, p, m, v), rs[0].pace.costs(v)).bubble_fraction
        actions = sum(k in ("F", "B", "W", "BW") for r in rs for _, k, *_ in r.timeline)
        rows[n] = (sim, measured_idle_fraction(rs, typical_step(rs)), sum(r.overruns for r in rs), actions)
    return PacedIdle(rows, next(iter(paced.values()))[0].pace.F, os.getloadavg()[0], os.cpu_count() or 1,
                     getattr(paced, "other_cores", None))


class PacedRuns(dict):
    """:func:`paced_runs`' runs, ``{(schedule, m, v): per-rank runs}``, and ``other_cores``: other processes' CPU
    while they ran, in cores (:class:`minipar.observe.busy.OtherWork`), which :func:`paced_idle` judges them by."""

    def __init__(self, runs: dict, other_cores: float | None = None):
        super().__init__(runs)
        self.other_cores = other_cores


def paced_runs(recipe, recipe8, p: int = 4, m: int = 8, pace=FIXED_PACE) -> dict:
    """§5's paced runs — GPipe and 1F1B on ``recipe``, interleaved v = 2 on ``recipe8`` — on their first batch only
    (a paced step is mostly sleep: a second one would double the wait and show the same timeline), in one launch,
    each checked equal to one device's first step: a :class:`PacedRuns`, ``{(schedule, m, v): per-rank runs}`` and
    the other processes' CPU while they ran."""
    first = [dataclasses.replace(r, batches=r.batches[:1]) for r in (recipe, recipe8)]     # v = 1, v = 2
    reference = [train_reference(r) for r in first]
    with OtherWork() as other:                  # other processes' CPU meanwhile: were the cores the runs'?
        runs = run_together(p, {(n, m, v): (first[v - 1], dict(schedule=n, m=m, v=v, pace=pace))
                                for n, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))})
    for (_, _, v), rs in runs.items():
        compare(reference[v - 1], rs, dtype=first[v - 1].dtype).assert_ok()
    return PacedRuns(runs, other.cores)


FIGURES = {
    "04_schedules.png": lambda path: save_figure(draw_schedules(), path),
    "04_measured_timelines.png": lambda path: save_figure(draw_measured(run_timelines()), path),
    "04_activation_memory.png": lambda path: save_figure(draw_memory(memory_runs()), path),
}


def schedule_or_error(schedule: str, p: int, m: int, v: int):
    """The simulated schedule, or the ValueError's text for a combination the schedule refuses."""
    try:
        return simulate(make_schedule(schedule, p, m, v if schedule == "interleaved" else 1))
    except ValueError as err:
        return f"ValueError: {err}"


def schedule_explorer():
    """Sliders for schedule, p, m and v above a Gantt chart redrawn from the action lists, titled with the simulated
    bubble beside the formula; an invalid combination shows its ValueError. First view: 1F1B, p = 4, m = 8."""
    import ipywidgets as widgets
    from minipar.pipeline import bubble_formula
    out = widgets.Output()

    def redraw(schedule="1f1b", p=4, m=8, v=2):
        sim, v = schedule_or_error(schedule, p, m, v), (v if schedule == "interleaved" else 1)
        with out:
            out.clear_output(wait=True)
            if isinstance(sim, str):
                print(sim)
                return
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(9, 0.45 * p + 0.8))
            draw_gantt(ax, sim_rows(sim), p, f"{schedule} p={p} m={m} v={v}: bubble {sim.bubble_fraction:.1%} "
                                             f"(formula {bubble_formula(schedule, p, m, v):.1%})")
            plt.show()

    controls = widgets.interactive(redraw, schedule=["naive", "gpipe", "1f1b", "interleaved"], p=(2, 8), m=(1, 32), v=(1, 4))
    schedule_menu, v_slider = controls.children[0], controls.children[3]
    widgets.dlink((schedule_menu, "value"), (v_slider, "disabled"), lambda s: s != "interleaved")   # v: chunks
    return widgets.VBox([controls, out])


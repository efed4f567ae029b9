"""Pipeline pieces shared by chapters 04 (GPipe → interleaved) and 04b (zero bubble and the V).

* :func:`schedule_row` — one schedule as a row of ``python -m minipar tour``: the tiny GPT (8 layers, hidden
  16, 2 heads, sequence 8, global batch 16 cut into m = 8 micro-batches of 2, Adam, 2 steps, float64) on 4
  ranks with :func:`minipar.pipeline.runtime.parallel_train`, compared with one device (float64 tolerance),
  its bytes per rank and step beside the formula 2 · c · m · A / p (:func:`bytes_formula`) and beside what
  the sockets carried (:mod:`minipar.wire`: the 2-step run minus a 1-step run, so setup cancels),
  its peak live bytes (:class:`minipar.memory.LiveTensorTracker`).
* :func:`draw_measured` — simulated (left) beside measured (right) Gantt charts of real runs, paced or not.
* :func:`beside_torch` — PyTorch's ``torch.distributed.pipelining`` counterpart of a schedule run on
  minipar's stages (:func:`minipar.pipeline.torch_ref.torch_pipeline_train`), what it executed set beside
  minipar's action lists and played on minipar's simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minipar import comm
from minipar.check import Comparison, compare, gpt_recipe, train_reference
from minipar.launcher import launch
from minipar.pipeline import runtime
from minipar.pipeline.gantt import draw_gantt, gantt_legend, sim_rows
from minipar.pipeline.schedules import Schedule, make_schedule
from minipar.pipeline.simulate import Costs, SimResult, simulate
from minipar.pipeline.timeline import measured_idle_fraction, step_rows, typical_step
from minipar.pipeline.torch_ref import TORCH_SCHEDULES, torch_pipeline_train
from minipar.course.tour import WORLD_SIZE, TourRow, observed_status

__all__ = ["M", "BATCH", "SEQ", "HIDDEN", "ACT_BYTES", "tour_recipe", "bytes_formula", "schedule_row", "run_together",
           "assert_rows_match", "GRID", "draw_measured", "side_by_side", "Beside", "beside_torch"]

M, BATCH, SEQ, HIDDEN = 8, 16, 8, 16
ACT_BYTES = (BATCH // M) * SEQ * HIDDEN * 8             # float64
NAMES = {"1f1b": "1F1B (PipeDream-Flush)", "gpipe": "GPipe", "interleaved": "interleaved 1F1B",
         "zb-h1": "zero bubble ZB-H1", "naive": "naive model parallel", "zb-v": "zero bubble ZB-V (V placement)",
         "dualpipev": "DualPipeV (V placement, F&B pairs run in turn)"}


def tour_recipe(optimizer: str = "adam", steps: int = 2):
    recipe = gpt_recipe(steps=steps, batch_size=BATCH, seq_len=SEQ, n_layer=8, n_embd=HIDDEN, n_head=2,
                        optimizer=optimizer)
    recipe.dtype = torch.float64
    return recipe


def bytes_formula(sched: Schedule, act_bytes: int = ACT_BYTES) -> float:
    """2 · c · m · A / p, c the stage boundaries whose two stages sit on different ranks (p·v − 1 round-robin,
    2p − 2 in a V, whose turn stays on rank p−1): read off the schedule's own placement."""
    crossings = sum(sched.rank_of(s) != sched.rank_of(s + 1) for s in range(sched.num_stages - 1))
    return 2 * crossings * sched.m * act_bytes / sched.p


def _observed_rank(rank, world_size, recipe, short, **config):
    """The run, and one step's bytes on the wire: observed(all steps) - observed(one step fewer), so that
    what both runs share (process groups, clock sync, gathering the results) cancels. The short run only
    cancels: it tracks no memory (its rows would be thrown away; tracking moves no bytes)."""
    seen = []
    for r in (short, recipe):
        with comm.recording() as log:
            run = runtime.parallel_train(rank, world_size, r, **(config if r is recipe else
                                                                  {**config, "track_memory": False}))
        seen.append(log.observed_bytes_sent)
    return run, None if None in seen else seen[1] - seen[0], log.count() / recipe.steps


def _runs_on_rank(rank, world_size, configs):
    return {key: runtime.parallel_train(rank, world_size, recipe, **config) for key, (recipe, config) in configs.items()}


def run_together(p: int, configs: dict) -> dict:
    """Several pipeline runs in one launch of ``p`` ranks (one start-up instead of one each): ``configs`` =
    ``{key: (recipe, keyword arguments of runtime.run)}``, each checked first; returns ``{key: per-rank runs}``,
    as ``runtime.run`` would for each."""
    for recipe, config in configs.values():
        runtime.validate(recipe, world_size=p, **config)
    per_rank = launch(_runs_on_rank, p, configs, quiet=True)
    return {key: [r[key] for r in per_rank] for key in configs}


def schedule_row(schedule: str, v: int = 1, recompute: bool = False) -> TourRow:
    """One schedule's tour row on 4 ranks, m = 8 (see the module's docstring)."""
    recipe, short = tour_recipe(), tour_recipe(steps=1)
    runtime.validate(recipe, world_size=WORLD_SIZE, schedule=schedule, m=M, v=v)
    out = launch(_observed_rank, WORLD_SIZE, recipe, short, schedule=schedule, m=M, v=v, recompute=recompute,
                 track_memory=True, quiet=True)
    runs = [o[0] for o in out]
    cmp = compare(train_reference(recipe), runs, dtype=recipe.dtype)
    sent = sum(r.bytes_sent for r in runs) / len(runs) / recipe.steps
    observed = None if any(o[1] is None for o in out) else sum(o[1] for o in out) / len(out)
    peak = max(b for r in runs for _, _, b in r.memory)
    sched = make_schedule(schedule, WORLD_SIZE, M, v)
    name = NAMES[schedule] + (f", v={v}" if schedule == "interleaved" else "")
    return TourRow(strategy=f"pipeline {name}{' + recompute' if recompute else ''}, pp={WORLD_SIZE}, m={M}",
                   world_size=WORLD_SIZE, matches=cmp.matches, max_abs_diff=cmp.max_abs_diff,
                   bytes_sent_per_rank=sent, bytes_formula=bytes_formula(sched),
                   peak_bytes_per_rank=peak,
                   note=f"bytes per step (observed: the {recipe.steps}-step run minus a 1-step run, so setup "
                        f"cancels; gloo frames each of the small activation messages); simulated bubble "
                        f"{simulate(sched).bubble_fraction:.3f}",
                   bytes_observed_per_rank=observed, calls_per_rank=sum(o[2] for o in out) / len(out))


GRID = 0.25                                 # paced charts: times drawn on a quarter-slot grid (see _on_grid)


def assert_rows_match(rows: dict) -> None:
    """Every schedule row equals one device and sends the formula's bytes; the sockets carry the formula plus
    gloo's framing per message (within the tour's allowance, never less)."""
    for name, row in rows.items():
        assert row.matches, (name, row)
        assert row.bytes_sent_per_rank == row.bytes_formula, (name, row)
        if row.bytes_observed_per_rank is not None:
            assert observed_status(row) == "within", (name, row.bytes_observed_per_rank, row.bytes_formula)
            assert row.bytes_observed_per_rank >= row.bytes_formula, (name, row)


def _on_grid(rows: list, unit: float) -> list:
    """Rows with times in slot units on the :data:`GRID`: a paced action starts and ends on its slot's
    boundaries, late by a wake-up and its sends (0.5-3 ms here), so a time is drawn at the grid point at
    most a quarter of the grid before it (1.25 ms early) or up to three quarters after (3.75 ms late)."""
    def snap(t):
        return math.floor(t / unit / GRID + 0.25) * GRID
    return [(*r[:4], snap(r[4]), snap(r[5])) for r in rows]


def draw_measured(runs_by_schedule: dict, p: int = 4):
    """Simulated (left) and measured (right) Gantt charts, with both idle fractions. Paced runs are drawn in
    slot units on the slot grid (reproducible), simulated with their slots' costs; unpaced ones in ms, with
    black lines where a rank waited in a receive."""
    import matplotlib.pyplot as plt
    n = len(runs_by_schedule)
    fig, axes = plt.subplots(n, 2, figsize=(12, 1.4 * n + 0.6), squeeze=False)
    paced, drawn = False, set()
    for (name, m, v), ax_row in zip(runs_by_schedule, axes):
        runs = runs_by_schedule[(name, m, v)]
        pace = runs[0].pace
        paced = pace is not None
        costs = Costs(F=1.0, B=pace.B / pace.F, W=pace.W / pace.F) if paced else Costs()   # F = 1
        sim = simulate(make_schedule(name, p, m, v), costs, overlap=False)   # F&B pairs run in turn, as here
        draw_gantt(ax_row[0], sim_rows(sim), p, f"{name} simulated: idle {sim.bubble_fraction:.1%}")
        step = max(r[0] for r in runs[0].timeline) if paced else typical_step(runs)   # paced: the last
        waits = step_rows(runs, step, kinds=("wait",))
        if paced:     # a paced receive waits inside its slot: the gaps between bars are the idle time
            rows, waits = _on_grid(step_rows(runs, step), v * pace.F), []
            idle = measured_idle_fraction(runs, typical_step(runs))   # the wall clock's, as paced_idle's table
        else:
            rows = [(r, k, s, i, 1e3 * a, 1e3 * b) for r, k, s, i, a, b in step_rows(runs, step)]
            waits = [(r, k, s, i, 1e3 * a, 1e3 * b) for r, k, s, i, a, b in waits]
            idle = measured_idle_fraction(runs, step)
        drawn |= {row[1] for row in sim_rows(sim) + rows}
        draw_gantt(ax_row[1], rows, p, f"{name} measured{' paced' if paced else ''} (step {step}): idle "
                                       f"{idle:.1%}" + (" (wall clock; bars on the slot grid)" if paced else ""),
                   labels=False)
        for rank, _, _, _, a, b in waits:                                    # blocked in a receive
            ax_row[1].plot([max(a, 0), b], [rank, rank], color="black", linewidth=1.2)
    axes[-1][0].set_xlabel("simulated time (F = 1)", fontsize=8)
    axes[-1][1].set_xlabel(f"measured, paced: time / a stage's F slot ({1e3 * pace.F:g} ms x v), 4 CPU processes"
                           if paced
                           else "measured ms (4 CPU processes, gloo)", fontsize=8)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.94, bottom=0.12, hspace=0.7, wspace=0.12)
    gantt_legend(fig, kinds=tuple(k for k in ("F", "BW", "B", "W") if k in drawn))   # only the kinds drawn
    return fig


def side_by_side(ours: list, theirs: list, width: int = 7, per_line: int = 16) -> str:
    """Two action lists of one rank, aligned column by column (``per_line`` columns a row), ``ours`` above
    ``theirs``, and ``^`` under the places where they differ."""
    out = []
    for k in range(0, max(len(ours), len(theirs)), per_line):
        a, b = [str(x) for x in ours[k:k + per_line]], [str(x) for x in theirs[k:k + per_line]]
        b += [""] * (len(a) - len(b))
        a += [""] * (len(b) - len(a))
        out += ["  ours  : " + "".join(x.ljust(width) for x in a),
                "  torch : " + "".join(x.ljust(width) for x in b)]
        marks = "".join(("^" if x != y else "").ljust(width) for x, y in zip(a, b)).rstrip()
        if marks:
            out.append("          " + marks)
    return "\n".join(out)


@dataclass
class Beside:
    """One schedule, PyTorch's run beside minipar's lists."""
    name: str
    torch_class: str
    comparison: Comparison          # PyTorch's training against one device
    executed_equal: bool            # what PyTorch ran == minipar's lists, on every rank
    order_equal: bool               # PyTorch's pipeline_order == minipar's lists, on every rank
    ours: SimResult
    theirs: SimResult               # PyTorch's executed lists on minipar's clock
    rank0: str                      # rank 0's lists aligned, '^' where they differ
    runs: list

    def __str__(self) -> str:
        return (f"{self.name} = {self.torch_class}: trains like one device ({self.comparison.max_abs_diff:.0e}); "
                f"executed lists equal ours on every rank: {self.executed_equal}\n"
                f"{self.rank0}\n  simulated: ours idle/total {self.ours.bubble_fraction:.1%}, "
                f"in flight {self.ours.peak_in_flight};  torch's {self.theirs.bubble_fraction:.1%}, "
                f"{self.theirs.peak_in_flight}")


def beside_torch(name: str, recipe, reference, p: int = 4, m: int = 8, v: int = 1) -> Beside:
    """Run PyTorch's counterpart of schedule ``name`` on ``p`` ranks and set it beside minipar's."""
    runs = launch(torch_pipeline_train, p, recipe, schedule=name, m=m, v=v, quiet=True)
    ours = make_schedule(name, p, m, v)
    executed = Schedule(f"torch {name}", p, m, v, [r.executed for r in runs], ours.placement, ours.overlapped)
    return Beside(name, TORCH_SCHEDULES[name], compare(reference, runs, dtype=recipe.dtype).assert_ok(),
                  executed.actions == ours.actions, [r.order for r in runs] == ours.actions,
                  simulate(ours), simulate(executed), side_by_side(ours.actions[0], executed.actions[0]), runs)

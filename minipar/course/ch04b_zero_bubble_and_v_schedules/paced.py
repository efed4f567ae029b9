"""Chapter 04b §4: 1F1B, ZB-H1, ZB-V and DualPipeV *paced* on the same slots, in one launch, beside the simulator.

Unpaced, on 2 shared cores, an action's wall time is the machine's (four ranks and other work contend for
the cores, a message waits for a wake-up), and ZB-V's measured idle lands beside 1F1B's. Paced
(:mod:`minipar.pipeline.paced`), every action computes, then sleeps to the end of its slot, so the timeline
is the schedule's and the simulator, given the same slots, predicts it.

The slots: the ZB-H1 run (the first, the only one with both B and W on whole stages) calibrates them
(:func:`minipar.pipeline.paced.calibrate`: each kind timed unloaded, the ranks taking turns, then scaled so
that the shortest slot is ``min_slot``; B and W keep their own measured lengths). Every other run uses the
same per-stage slots; a V chunk is half a stage's layers, so its slots are halved (:func:`per_chunk`), and
every schedule does the same work per rank: the simulator's costs (``Pace.costs(v)``) are identical.

What is measured, per schedule and step (``steps`` of them): the idle fraction (chapter 04's one definition,
1 − Σ action spans / (p · step)) and the step's wall time (first action's start to last action's end);
the spread is min–max over the steps. Predicted: :func:`minipar.pipeline.simulate.simulate` with those costs;
DualPipeV with ``overlap=False``, since the runtime runs each F&B pair as two actions in turn (§5). Each run
is compared with one device (float64 harness tolerance).

Slots: ``min_slot`` = 16 ms per stage, 8 ms per chunk. The compute is well under 1 ms; the rest is slack for
a rank woken late: on this machine at load average ~5-9 a woken rank often waits 1-5 ms for a core; with 5-6 ms
chunk slots 20-50 % of ZB-V's actions overran, with 8 ms 2-18 %. An overrun is counted
(``PipelineRun.overruns``); the slots stay on the schedule's clock, so a late action is caught up by the next
and the idle stays close to the simulator's (ZB-V 6.6-9.8 % against 6.5 % simulated in those runs). A run with
more than 5 % of its actions overrun, or run while other processes had the cores (over a quarter of a core:
:class:`minipar.observe.busy.OtherWork`), is *disturbed*: named in the table, and its idle not held to the
simulator's (at load ~15, a stalled rank took 1F1B's idle from 27 % to 7-9 %, beside stretched steps).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.launcher import launch
from minipar.observe.busy import OtherWork, disturbed, too_busy
from minipar.pipeline import runtime
from minipar.pipeline.paced import Pace
from minipar.pipeline.schedules import make_schedule
from minipar.pipeline.simulate import simulate
from minipar.pipeline.timeline import measured_idle_fraction, step_rows

__all__ = ["SHOWN", "MIN_SLOT", "per_chunk", "paced_recipe", "PacedSchedule", "PacedComparison", "paced_runs"]

SHOWN = (("zb-h1", 1), ("1f1b", 1), ("zb-v", 2), ("dualpipev", 2))   # ZB-H1 first: it calibrates the slots
MIN_SLOT = 0.016             # seconds: the shortest per-stage slot (F's, here)


def per_chunk(stage: Pace, v: int) -> Pace:
    """The slots of one chunk of ``v`` per stage (1/v of its layers): ``stage``'s divided by v, so that
    ``per_chunk(stage, v).costs(v) == stage.costs(1)``, the simulator's costs."""
    return Pace(stage.F / v, stage.B / v, stage.W / v)


def paced_recipe(steps: int = 3):
    """The chapter's 8-block GPT (hidden 32, sequence 8, global batch 16, float64), ``steps`` steps."""
    recipe = gpt_recipe(steps=steps, batch_size=16, seq_len=8, n_layer=8, n_embd=32, n_head=2)
    recipe.dtype = torch.float64
    return recipe


def _paced_on_rank(rank, world_size, recipe, m, min_slot):
    """This rank's runs of every schedule of :data:`SHOWN`: ZB-H1 calibrates, the others reuse its slots."""
    name, v = SHOWN[0]
    runs = {name: runtime.parallel_train(rank, world_size, recipe, schedule=name, m=m, v=v,
                                         pace={"min_slot": min_slot})}
    stage = runs[name].pace
    for name, v in SHOWN[1:]:
        runs[name] = runtime.parallel_train(rank, world_size, recipe, schedule=name, m=m, v=v,
                                            pace=per_chunk(stage, v))
    return runs


@dataclass
class PacedSchedule:
    """One schedule's paced run: predicted and measured idle and step time, overruns, equality with one device."""
    simulated_idle: float
    simulated_step: float      # seconds
    idle: list                 # per step
    step: list                 # seconds per step
    overruns: int
    actions: int
    matches: bool              # equal to one device (float64 tolerance)



def _spread(xs: list, scale: float = 1.0, fmt: str = ".1%") -> str:
    return (f"{format(scale * statistics.median(xs), fmt)} ({format(scale * min(xs), fmt)}–"
            f"{format(scale * max(xs), fmt)})")


@dataclass
class PacedComparison:
    """Every schedule of one paced launch (``rows``, by name), the per-stage slots, the load it ran under and the other
    processes' CPU while it ran, in cores (:class:`minipar.observe.busy.OtherWork`; None: not measured)."""
    rows: dict
    pace: Pace
    load: float
    other: float | None = None

    def apart(self, better: str = "zb-v", worse: str = "1f1b") -> bool:
        """``better`` idles less and steps faster than ``worse``, outside the run-to-run spread: each one's
        median idle outside the other's min–max over the steps, and ``better``'s median step shorter than
        ``worse``'s fastest. (Not ``better``'s slowest step: a rank descheduled by other work only lengthens
        a step, so one such step says nothing about the schedule.)"""
        b, w = self.rows[better], self.rows[worse]
        median = statistics.median
        return (median(b.idle) < min(w.idle) and max(b.idle) < median(w.idle)
                and median(b.step) < min(w.step))

    def agrees(self, within: float = 0.05) -> bool:
        """Every undisturbed run's median idle within ``within`` of the simulator's."""
        return all(abs(statistics.median(r.idle) - r.simulated_idle) < within
                   for n, r in self.rows.items() if n not in self.disturbed)

    @property
    def disturbed(self) -> list:
        """The shared rule (:func:`minipar.observe.busy.disturbed`): more than 5 % of the run's actions overran, or other
        processes had the cores while it ran (the load average where that was not measured)."""
        return [n for n, r in self.rows.items() if disturbed(r.overruns, r.actions, self.load, other=self.other)]

    def sentence(self, better: str = "zb-v", worse: str = "1f1b") -> str:
        """The lesson, as this run measured it: median (min–max over the steps)."""
        b, w = self.rows[better], self.rows[worse]
        where = "outside the spread" if self.apart(better, worse) else "the spreads overlap"
        return (f"{better.upper()} idles {_spread(b.idle)} against {worse.upper()}'s {_spread(w.idle)}, {where}; "
                f"its step takes {_spread(b.step, 1e3, '.0f')} ms against {_spread(w.step, 1e3, '.0f')} ms.")

    def __str__(self) -> str:
        steps = len(next(iter(self.rows.values())).idle)
        out = [f"slots per stage: F {1e3 * self.pace.F:.1f} ms, B {1e3 * self.pace.B:.1f} ms, W {1e3 * self.pace.W:.1f}"
               f" ms (a V chunk: half); {steps} steps each, median (min–max); load average {self.load:.1f}"
               + ("" if self.other is None else f", other processes {self.other:.2f} cores meanwhile"),
               f"{'':10s}  {'idle simulated':>14s}  {'idle measured':>21s}  {'step simulated':>14s}  "
               f"{'step measured (ms)':>20s}  overruns  equals one device"]
        for n, r in self.rows.items():
            out.append(f"{n:10s}  {r.simulated_idle:14.1%}  {_spread(r.idle):>21s}  {1e3 * r.simulated_step:11.0f} ms"
                       f"  {_spread(r.step, 1e3, '.0f'):>20s}  {r.overruns:3d} of {r.actions:<4d} {r.matches}")
        out += [f"  {n}: {too_busy(self.rows[n].overruns, self.rows[n].actions, self.load, other=self.other)}"
                for n in self.disturbed]
        return "\n".join(out)


def paced_runs(p: int = 4, m: int = 8, steps: int = 3, min_slot: float = MIN_SLOT):
    """Every schedule of :data:`SHOWN` paced on ``p`` ranks, in one launch: ``({name: per-rank runs},
    PacedComparison)``."""
    recipe = paced_recipe(steps)
    for name, v in SHOWN:
        runtime.validate(recipe, world_size=p, schedule=name, m=m, v=v)
    with OtherWork() as other:                  # other processes' CPU meanwhile: were the cores the runs'?
        per_rank = launch(_paced_on_rank, p, recipe, m, min_slot, quiet=True)
    load = os.getloadavg()[0]
    reference = train_reference(recipe)
    runs, rows = {}, {}
    for name, v in SHOWN:
        rs = runs[(name, m, v)] = [r[name] for r in per_rank]
        sim = simulate(make_schedule(name, p, m, v), rs[0].pace.costs(v), overlap=False)
        rows[name] = PacedSchedule(
            sim.bubble_fraction, sim.makespan,
            [measured_idle_fraction(rs, s) for s in range(steps)],
            [max(row[5] for row in step_rows(rs, s)) for s in range(steps)],
            sum(r.overruns for r in rs), sum(k in ("F", "B", "W", "BW") for r in rs for _, k, *_ in r.timeline),
            compare(reference, rs, dtype=recipe.dtype).matches)
    return runs, PacedComparison(rows, per_rank[0][SHOWN[0][0]].pace, load, other.cores)

"""Chapter 04, Deeper A: why an unpaced pipeline idles more than (p-1)/(m+p-1) — measured, replayed here, replayed on
a named cluster.

One real run of a schedule is traced (:mod:`minipar.observe.tracer`: every rank's compute between its messages, in
thread CPU seconds and wall seconds) with a mark at each action's start, input arrival and end
(:class:`MarkedRank`, the runtime's own seams). The trace is then played by :func:`minipar.machine.replay.replay` on
clusters that add one term at a time (:func:`idle_terms`):

* ``formula`` — (p-1)/(m+p-1): equal stages, free and instant transfers (GPipe, Huang et al. 2019);
* ``stages`` — the trace's own compute (each segment's CPU seconds: unequal stages, Python overhead), on
  free links;
* ``p2p`` — the same, on links of the α and β measured here between two ranks (:func:`p2p_link`);
* ``cores`` — the same links, each compute segment lasting its *wall* seconds: what sharing the cores with
  the other ranks (and other jobs) stretched it to;
* ``measured`` — the run's own timeline on the wall clock (:func:`minipar.pipeline.timeline.measured_idle_fraction`);
* ``dgx_a100`` — a model: the same program run once more with its operators counted
  (:mod:`minipar.observe.opcount`), each compute segment priced on the A100 card (roofline + a launch floor per
  kernel, :mod:`minipar.machine.device`) on one DGX-A100 node's NVLink (:func:`minipar.machine.cluster.a100_cluster`)
  — never CPU seconds scaled: they say nothing of a GPU.

Every idle fraction is the same quantity as the measured one: 1 - Σ action spans / (p · step), an action's span
starting once its input is there; the replayed spans come from the marks (:func:`replayed_runs`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from minipar.check import compare
from minipar.observe import tracer
from minipar.machine.cluster import a100_cluster, this_machine
from minipar.machine.fidelity import wall_compute
from minipar.observe.launch_trace import traced_launch
from minipar.observe.measure import calibrate_links, fit_p2p
from minipar.machine.replay import replay
from minipar.observe.opcount import kernel_count
from minipar.machine.trace import Compute, Mark, Trace
from minipar.pipeline import runtime
from minipar.pipeline.gantt import draw_gantt, gantt_legend
from minipar.pipeline.runtime import PipelineRank
from minipar.pipeline.schedules import bubble_formula
from minipar.pipeline.timeline import measured_idle_fraction, step_rows

__all__ = ["MarkedRank", "traced_run", "replayed_runs", "p2p_link", "idle_terms", "action_kernels",
           "stage_work", "draw_terms", "TERMS", "TITLES", "IdleBreakdown", "idle_breakdown"]

TERMS = ("formula", "stages", "p2p", "cores", "measured", "dgx_a100")


class MarkedRank(PipelineRank):
    """The runtime's rank, putting a :func:`minipar.observe.tracer.mark` where an action begins, where its input
    arrived and where it ends (``done <kind> <stage> <microbatch>``)."""

    def begin_action(self, action) -> None:
        super().begin_action(action)
        tracer.mark("begin")

    def wait_for(self, buf, src: int, tag: int, stage: int, microbatch: int) -> None:
        super().wait_for(buf, src, tag, stage, microbatch)
        tracer.mark("arrived")

    def action_done(self, kind: str) -> None:
        tracer.mark(f"done {kind} {self.action.stage} {self.action.microbatch}")
        super().action_done(kind)


def traced_run(recipe, *, schedule: str, p: int, m: int, ops: bool = False) -> tuple:
    """(per-rank PipelineRuns, :class:`minipar.machine.trace.Trace`) of one unpaced run, every rank traced
    (:func:`minipar.observe.launch_trace.traced_launch`; ``ops``: operators counted, for the A100 model)."""
    runtime.validate(recipe, world_size=p, schedule=schedule, m=m)
    return traced_launch(runtime.parallel_train, p, recipe, schedule=schedule, m=m, rank_class=MarkedRank,
                         quiet=True, ops=ops, meta={"schedule": schedule, "p": p, "m": m})


def replayed_runs(result, steps: int) -> list:
    """The replay's action spans as runs with a ``timeline`` (rows ``(step, kind, stage, microbatch, start,
    end)``, as the runtime records them), so that :func:`step_rows`, :func:`measured_idle_fraction` and the
    chapter's Gantt charts read a replay as they read a run. ``steps``: the run's optimizer steps."""
    runs = []
    for marks in result.marks:
        rows, begin, arrived = [], 0.0, 0.0
        for label, t in marks:
            if label == "begin":
                begin, arrived = t, 0.0
            elif label == "arrived":
                arrived = t
            elif label.startswith("done "):
                _, kind, stage, mb = label.split()
                rows.append([kind, int(stage), int(mb), max(begin, arrived), t])
        per_step = len(rows) // steps
        runs.append(SimpleNamespace(timeline=[(i // per_step, *row) for i, row in enumerate(rows)]))
    return runs


def p2p_link(sizes=(256, 4096, 65536), reps: int = 20) -> tuple:
    """(α seconds, β bytes/s, {bytes: seconds}) of one message between two ranks here: a blocking send/recv
    ping-pong (:func:`minipar.observe.measure.calibrate_links`), the fastest one-way time of ``reps`` round trips
    per size (the link, not the wait for a core: that is the ``cores`` term), fitted to t = α + S/β
    (:func:`minipar.observe.measure.fit_p2p`, least squares in relative error); β = ∞ when the fastest times do
    not grow with S (small sizes, a busy machine)."""
    links = calibrate_links(2, ops=(), p2p_sizes=sizes, repeats=reps + 1)    # the first round trip: a warm-up
    samples = links.p2p_seconds(min)
    beta, alpha = fit_p2p(samples)
    return alpha, beta, samples


def draw_terms(terms: dict, p: int, shown=("stages", "p2p", "cores", "measured"), step: int = -1):
    """Gantt charts (ms) of one step: the replays of ``shown`` and the measured timeline, idle fraction in
    each title (a matplotlib Figure)."""
    import matplotlib.pyplot as plt          # heavy, and only for drawing
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.2 * len(shown) + 0.8), sharex=True)
    for ax, name in zip(axes, shown):
        idle, runs = terms[name]
        rows = [(r, k, s, i, 1e3 * a, 1e3 * b) for r, k, s, i, a, b in step_rows(runs, step)]
        label = "measured (wall clock)" if name == "measured" else f"replayed here: {TITLES[name]}"
        draw_gantt(ax, rows, p, f"{label}: idle {idle:.1%}", labels=False)
    axes[-1].set_xlabel("ms (4 CPU processes)", fontsize=8)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.93, bottom=0.14, hspace=0.7)
    gantt_legend(fig, kinds=("F", "BW"))   # this chapter's kinds: 04b adds B and W
    return fig


TITLES = {"stages": "measured CPU costs, free links", "p2p": "+ measured p2p α, β",
          "cores": "+ compute stretched to its wall time (shared cores)", "dgx_a100": "model: one DGX-A100 node"}


def stage_work(runs: list, step: int) -> list:
    """Seconds of action spans per rank in ``step`` (each rank holds one stage here)."""
    rows = step_rows(runs, step)
    return [sum(b - a for r, _, _, _, a, b in rows if r == rank) for rank in range(len(runs))]


def action_kernels(counted: Trace, steps: int, step: int = -1) -> list:
    """Kernels each rank launches inside its actions of ``step`` (from each action's start, or its input's
    arrival, to its end: the spans :func:`stage_work` sums), in a trace with operators counted."""
    out = []
    for rank in counted.ranks:
        per_action, inside, kernels = [], False, 0
        for e in rank.events:
            if isinstance(e, Mark) and e.label in ("begin", "arrived"):
                inside, kernels = True, 0
            elif isinstance(e, Mark) and e.label.startswith("done "):
                per_action.append(kernels)
                inside = False
            elif inside and isinstance(e, Compute):
                kernels += kernel_count(e.ops)
        per_step = len(per_action) // steps
        out.append(sum(per_action[(step % steps) * per_step:(step % steps + 1) * per_step]))
    return out


def idle_terms(runs: list, traced: Trace, *, alpha: float, beta: float, counted: Trace,
               step: int = -1) -> dict:
    """{term: (idle fraction, replayed runs or the measured runs)} for :data:`TERMS` (see the module's
    docstring), all of step ``step`` of the same run; ``counted``: the same program's trace with its
    operators counted (:func:`traced_run` with ``ops=True``), for the A100 model."""
    meta, steps = traced.meta, 1 + max(row[0] for row in runs[0].timeline)
    p, step = meta["p"], step % steps
    free = this_machine(0.0, float("inf"), 1.0, devices=p)
    here = replace(free, intra_latency=alpha, inter_latency=alpha, intra_bw=beta, inter_bw=beta)
    played = {"stages": replay(traced, free, compute_scale=1.0),
              "p2p": replay(traced, here, compute_scale=1.0),
              "cores": replay(wall_compute(traced), here, compute_scale=1.0),
              "dgx_a100": replay(counted, a100_cluster(1))}
    out = {"formula": (bubble_formula(meta["schedule"], p, meta["m"]), None),
           "measured": (measured_idle_fraction(runs, step), runs)}
    for name, result in played.items():
        as_runs = replayed_runs(result, steps)
        out[name] = (measured_idle_fraction(as_runs, step), as_runs)
    return {name: out[name] for name in TERMS}


@dataclass
class IdleBreakdown:
    """One schedule's step: its idle fraction term by term (:data:`TERMS`), the work per rank (CPU seconds,
    wall seconds, model DGX-A100 seconds) and the kernels each rank launched in its actions."""
    schedule: str
    terms: dict                 # {term: (idle fraction, runs)} from :func:`idle_terms`
    work: dict                  # {"stages" | "cores" | "dgx_a100": seconds per rank}
    kernels: list               # per rank, in the step's actions

    @property
    def idle(self) -> dict:
        return {t: self.terms[t][0] for t in TERMS}

    @property
    def launch_floors(self) -> list:
        """Per rank: kernels × the 5 µs launch floor of the A100 model (:mod:`minipar.machine.device`)."""
        return [k * 5e-6 for k in self.kernels]

    @property
    def explained(self) -> float:
        """The share of the gap formula → measured that the replay with shared cores accounts for."""
        i = self.idle
        return (i["cores"] - i["formula"]) / (i["measured"] - i["formula"])

    def __str__(self) -> str:
        i, labels = self.idle, {"formula": "formula (p-1)/(m+p-1)", "measured": "measured (wall clock here)", **TITLES}
        out = [f"{'idle fraction of one step, the traced ' + self.schedule + ' run':52s} {'':>7s}"]
        pct = {t: round(100 * i[t]) for t in i}   # whole points (one run, which a rerun moves), rows and steps alike
        out += [f"{labels[t]:52s} {pct[t]:6d}%" for t in TERMS]
        return "\n".join(out)

    def steps(self) -> str:
        """The ladder read row by row in the whole points it prints: what each added cost moved, its wording set
        by the sign (stretching compute lengthens the busy time too, so it can lower the fraction)."""
        pct = {t: round(100 * v) for t, v in self.idle.items()}

        def points(d):
            return f"{abs(d)} point{'s' * (abs(d) != 1)}"

        def moved(a, b):
            d = pct[b] - pct[a]
            return f"adds {points(d)}" if d > 0 else f"removes {points(d)}" if d < 0 else "leaves it unchanged"
        stretching_did_not_add = pct["cores"] <= pct["p2p"]
        rest = pct["measured"] - pct["cores"]
        return (f"From the formula's {pct['formula']}%: measuring the unequal stages {moved('formula', 'stages')}; "
                f"message latency {moved('stages', 'p2p')}; stretching compute to its wall time "
                f"{moved('p2p', 'cores')}" + (", since it lengthens the busy time as well as the waits" if stretching_did_not_add else "")
                + f"; the measured run, {pct['measured']}%, lies {points(rest)} {'above' if rest >= 0 else 'below'} "
                f"that replay.")

    def reading(self) -> str:
        """One sentence on the rest (measured - replay with shared cores), its wording set by its sign."""
        rest = self.idle["measured"] - self.idle["cores"]
        if rest >= 0:
            return (f"the replay accounts for {self.explained:.0%} of the gap formula -> measured; the rest, "
                    f"{round(100 * self.idle['measured']) - round(100 * self.idle['cores']):+d} points, is what no term prices, such as a rank whose message has arrived "
                    f"waiting for a core")
        return (f"the replay overshoots the measurement ({self.explained:.0%} of the gap): the terms are not additive. "
                f"A segment's wall time already holds the waits for a core that stretched it where it ran; replayed, "
                f"that stretch lands where the run had a core free, so part of the waiting is counted twice")


def idle_breakdown(recipe, reference, *, schedule: str, p: int, m: int, alpha: float, beta: float) -> IdleBreakdown:
    """Trace one real unpaced run (checked against ``reference``: tracing changes no number), run the same
    program once more with its operators counted, and replay it term by term (:func:`idle_terms`)."""
    traced_runs, traced = traced_run(recipe, schedule=schedule, p=p, m=m)
    compare(reference, traced_runs, dtype=recipe.dtype).assert_ok()
    counted = traced_run(recipe, schedule=schedule, p=p, m=m, ops=True)[1]
    terms = idle_terms(traced_runs, traced, alpha=alpha, beta=beta, counted=counted)
    work = {t: stage_work(terms[t][1], -1) for t in ("stages", "cores", "dgx_a100")}
    return IdleBreakdown(schedule, terms, work, action_kernels(counted, steps=len(recipe.batches), step=-1))

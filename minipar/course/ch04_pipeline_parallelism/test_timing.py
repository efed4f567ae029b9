"""Chapter 04's replayed pipeline (timing.py): the marks read back as the runtime's rows, and a real run's
trace, costed as the formula assumes, replays to the formula exactly."""
import math

import pytest
import torch

from minipar.check import gpt_recipe
from minipar.course.ch04_pipeline_parallelism import claims, timing
from minipar.pipeline.schedules import bubble_formula
from minipar.pipeline.timeline import measured_idle_fraction, step_rows
from minipar.machine.cluster import this_machine
from minipar.machine.replay import replay
from minipar.machine.trace import Comm, Compute, Mark, RankTrace, Trace, Wait

FREE = this_machine(0.0, float("inf"), 1.0, devices=4)


@pytest.fixture(scope="module")
def traced():
    recipe = gpt_recipe(steps=2, batch_size=8, seq_len=8, n_layer=4, n_embd=16, n_head=2)
    recipe.dtype = torch.float64
    return {s: timing.traced_run(recipe, schedule=s, p=4, m=4) for s in ("gpipe", "1f1b")} | \
        {"1f1b counted": timing.traced_run(recipe, schedule="1f1b", p=4, m=4, ops=True)}


def _as_formula_assumes(trace: Trace) -> Trace:
    """Every action's first compute segment once its input is there costs F = 1 or BW = 2; all else 0."""
    out = []
    for rank in trace.ranks:
        events, pending = [], False
        for i, e in enumerate(rank.events):
            if isinstance(e, Mark) and e.label in ("begin", "arrived"):
                label, kind = _next_mark(rank.events, i + 1)
                pending = label != "arrived"         # with a receive: the work starts once it arrived
            if isinstance(e, Compute):
                cost = {"F": 1.0, "BW": 2.0}[kind] if pending else 0.0
                e, pending = Compute(cost, cost), False
            events.append(e)
        out.append(RankTrace(rank.rank, events))
    return Trace(out, dict(trace.meta))


def _next_mark(events, i):
    """(the next mark's label, the kind of the action that ends next) from event ``i`` on."""
    label = next(e.label for e in events[i:] if isinstance(e, Mark))
    return label, next(e.label.split()[1] for e in events[i:] if isinstance(e, Mark) and e.label.startswith("done "))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_real_trace_costed_as_the_formula_assumes_replays_to_the_formula(traced, schedule):
    runs, trace = traced[schedule]
    played = timing.replayed_runs(replay(_as_formula_assumes(trace), FREE, compute_scale=1.0), steps=2)
    assert [len(r.timeline) for r in played] == [sum(k in ("F", "BW") for _, k, *_ in r.timeline) for r in runs]
    for step in (0, 1):
        rows = step_rows(played, step)
        assert sorted((r, k, s, i) for r, k, s, i, *_ in rows) == \
            sorted((r, k, s, i) for r, k, s, i, *_ in step_rows(runs, step))      # the run's own actions
        assert math.isclose(measured_idle_fraction(played, step), bubble_formula(schedule, 4, 4), abs_tol=1e-12)


def test_replayed_runs_reads_marks_as_rows_and_spans_start_when_the_input_arrived():
    a = [Mark("begin"), Compute(1.0), Mark("done F 0 0"), Comm("send", (0, 1), 8, True),
         Mark("begin"), Compute(2.0), Mark("done BW 0 0")]
    b = [Mark("begin"), Comm("recv", (0, 1), 8, True, waited_at=2), Wait(1), Mark("arrived"), Compute(1.0),
         Mark("done F 1 0")]
    played = timing.replayed_runs(replay(Trace([RankTrace(0, a), RankTrace(1, b)]),
                                         this_machine(0.5, float("inf"), 1.0, devices=2), compute_scale=1.0), 1)
    assert played[0].timeline == [(0, "F", 0, 0, 0.0, 1.0), (0, "BW", 0, 0, 1.0, 3.0)]
    assert played[1].timeline == [(0, "F", 1, 0, 1.5, 2.5)]          # begins at 0, its input arrives at 1 + 0.5


def test_idle_terms_order_the_terms_the_chapter_asserts(traced):
    runs, trace = traced["1f1b"]
    alpha, beta, samples = timing.p2p_link(sizes=(256, 65536), reps=5)
    assert alpha > 0 and beta > 0 and set(samples) == {256, 65536}
    counted = traced["1f1b counted"][1]
    terms = timing.idle_terms(runs, trace, alpha=alpha, beta=beta, counted=counted)
    idle = {k: v for k, (v, _) in terms.items()}
    assert tuple(idle) == timing.TERMS and idle["formula"] == bubble_formula("1f1b", 4, 4)
    assert idle["formula"] - claims.STAGE_NOISE < idle["stages"] <= idle["p2p"] + 1e-12
    assert idle["dgx_a100"] > idle["formula"]
    assert all(0 <= v < 1 for v in idle.values())
    # the A100 model is launch-bound: every rank's work in a step is at least its kernels × the 5 µs floor
    work = timing.stage_work(terms["dgx_a100"][1], -1)
    kernels = timing.action_kernels(counted, steps=2, step=-1)
    assert all(w >= k * 5e-6 * (1 - 1e-9) for w, k in zip(work, kernels)) and min(kernels) > 50


def test_the_reading_of_the_rest_follows_its_sign():
    """The sentence under the breakdown: a positive rest is 'what no term prices', a negative one an overshoot."""
    from minipar.course.ch04_pipeline_parallelism.timing import TERMS, IdleBreakdown
    idle = dict(formula=0.27, stages=0.38, p2p=0.41, cores=0.49, dgx_a100=0.34)
    short = IdleBreakdown("1f1b", {t: (v, None) for t, v in {**idle, "measured": 0.70}.items()}, {}, [])
    over = IdleBreakdown("1f1b", {t: (v, None) for t, v in {**idle, "measured": 0.45}.items()}, {}, [])
    assert set(short.idle) == set(TERMS)
    assert "no term prices" in short.reading() and "overshoots" not in short.reading()
    assert "overshoots" in over.reading() and "no term prices" not in over.reading()


def test_the_ladders_steps_are_its_printed_points():
    """The line under the ladder: each step in the whole points the rows print, a fall in stretched compute explained."""
    from minipar.course.ch04_pipeline_parallelism.timing import IdleBreakdown
    idle = dict(formula=3 / 11, stages=0.36, p2p=0.40, cores=0.39, measured=0.47, dgx_a100=0.34)
    fell = IdleBreakdown("1f1b", {t: (v, None) for t, v in idle.items()}, {}, []).steps()
    assert "adds 9 points" in fell and "adds 4 points" in fell and "removes 1 point," in fell and "busy time" in fell
    assert "47%, lies 8 points above" in fell
    rose = IdleBreakdown("1f1b", {t: (v, None) for t, v in {**idle, "cores": 0.43}.items()}, {}, []).steps()
    assert "adds 3 points" in rose and "busy time" not in rose

"""Every pipeline schedule trains exactly like one device (gloo, CPU ranks), and like PyTorch's pipelining.

Tolerance: float32 defaults of minipar.check (atol 2e-5, rtol 1e-4): the gradient of the global batch is
summed micro-batch by micro-batch, a different order of float additions than one big batch (the observed
max |Δ| is ~1e-6 to 1e-5 after a few Adam steps, 0 to 3e-8 with SGD on the MLP).
"""
import dataclasses

import pytest
import torch

from minipar import launch
from minipar.check import RunResult, check_equivalence, compare, gpt_recipe, mlp_recipe
from minipar.pipeline.runtime import PipelineRank, parallel_train
from minipar.pipeline.torch_ref import torch_pipeline_train

MLP = mlp_recipe(steps=2, batch_size=12, sizes=[8] * 13)           # 12 layers: p·v in {1,2,3,4,6,12}
GPT = gpt_recipe(steps=2, batch_size=8, seq_len=8, n_layer=4, n_embd=16, n_head=2)
QUIET = {"quiet": True}


@pytest.mark.parametrize("schedule,p,m,v", [
    ("naive", 2, 1, 1), ("gpipe", 2, 4, 1), ("gpipe", 4, 3, 1), ("1f1b", 4, 4, 1), ("1f1b", 2, 6, 1),
    ("zb-h1", 4, 4, 1), ("zb-h1", 3, 6, 1), ("interleaved", 2, 4, 2), ("interleaved", 2, 2, 3),
    ("interleaved", 3, 6, 2),
])
def test_mlp_schedules_equal_single_device(schedule, p, m, v):
    check_equivalence(parallel_train, p, MLP, schedule=schedule, m=m, v=v, launch_kwargs=QUIET).assert_ok()


GPT8 = gpt_recipe(steps=2, batch_size=8, seq_len=8, n_layer=8, n_embd=16, n_head=2)
GPT8_F64 = dataclasses.replace(GPT8, dtype=torch.float64)          # float64: equal within 1e-10 (TOLERANCES)


@pytest.mark.parametrize("schedule,p,m,v", [("zb-v", 2, 4, 2), ("dualpipev", 2, 4, 2), ("v-min", 2, 4, 2),
                                            ("v-half", 2, 4, 2)])
def test_v_schedules_equal_single_device_mlp(schedule, p, m, v):
    check_equivalence(parallel_train, p, MLP, schedule=schedule, m=m, v=v, launch_kwargs=QUIET).assert_ok()


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev", "v-half"])
def test_v_schedules_on_4_ranks_equal_single_device_and_hand_over_locally(schedule):
    """8 stages on 4 ranks in a V, float64 (equal to one device within atol 1e-10, rtol 1e-9 after 2 Adam
    steps); stages 3 and 4 share rank 3, so their tensors are handed over without a message: the bytes sent
    are the checker's message count (6 rank boundaries, not 7) times a tensor."""
    from minipar.check import train_reference
    from minipar.pipeline.checker import check
    from minipar.pipeline.schedules import make_schedule
    # one launch for both checks (check_equivalence's compare on these runs, then their losses and bytes)
    runs = launch(parallel_train, 4, GPT8_F64, schedule=schedule, m=8, v=2, quiet=True)
    cmp = compare(train_reference(GPT8_F64), runs, dtype=GPT8_F64.dtype)
    cmp.assert_ok()
    assert (cmp.atol, cmp.rtol) == (1e-10, 1e-9)                   # float64 tolerances
    assert runs[0].losses is not None and all(r.losses is None for r in runs[1:])   # the loss is on rank 0
    messages = check(make_schedule(schedule, 4, 8, 2))
    assert messages == 2 * 8 * 6
    tensor = (8 // 8) * 8 * 16 * 8                                  # one micro-batch's activation, float64
    assert sum(r.bytes_sent for r in runs) == GPT8.steps * messages * tensor


def test_the_loss_is_an_argument():
    """A loss_fn of twice the default trains like one device on a doubled loss (the losses double)."""
    from minipar.pipeline.stages import stage_loss
    from minipar.course.pipeline_views import run_together
    both = run_together(2, {"doubled": (GPT, dict(schedule="1f1b", m=4, loss_fn=lambda y, t: 2 * stage_loss(y, t))),
                            "plain": (GPT, dict(schedule="1f1b", m=4))})          # one launch for both
    runs, plain = both["doubled"], both["plain"]
    assert runs[1].losses[0] == pytest.approx(2 * plain[1].losses[0], rel=1e-6)


def _each_layout(rank, world_size, recipe, layouts):
    from minipar.hybrid.runner import parallel_train as train3d
    return {key: train3d(rank, world_size, recipe, layout=layout, track_memory=True) for key, layout in layouts.items()}


def test_hybrid_trainer_recomputes_and_still_equals_one_device():
    from minipar.check import train_reference
    from minipar.hybrid.parallel3d import DEFAULTS, validate
    from minipar.layout import Layout
    recipe = gpt_recipe(steps=2, batch_size=16, seq_len=8, n_layer=4)
    recipe.dtype = torch.float64
    layouts = {recompute: Layout.of(None, DEFAULTS, dp=1, pp=2, tp=2, recompute=recompute)
               for recompute in ("none", "full")}
    for layout in layouts.values():
        validate(recipe, world_size=4, layout=layout)
    # both runs in one launch (as run3d would launch each: 120 s collective timeout); one reference for both
    both = launch(_each_layout, 4, recipe, layouts, quiet=True, timeout=120.0)
    peaks, reference = {}, train_reference(recipe)
    for recompute in layouts:
        runs = [b[recompute] for b in both]
        compare(reference, runs, dtype=torch.float64).assert_ok()
        peaks[recompute] = max(r.peak_bytes for r in runs)
    assert peaks["full"] < peaks["none"], peaks                     # the activations were dropped


@pytest.mark.parametrize("schedule,p,m,v,recompute", [
    ("gpipe", 2, 4, 1, True), ("1f1b", 4, 4, 1, False), ("interleaved", 2, 4, 2, False),
    ("zb-h1", 2, 4, 1, True),
])
def test_gpt_schedules_equal_single_device(schedule, p, m, v, recompute):
    if not recompute and (schedule, p, m, v) in TORCH_CASES:
        # the very run test_equals_torch_distributed_pipelining makes (GPT, same schedule): launched once for both
        from minipar.check import train_reference
        compare(train_reference(GPT), beside_torch(schedule, p, m, v)[0], dtype=GPT.dtype).assert_ok()
        return
    check_equivalence(parallel_train, p, GPT, schedule=schedule, m=m, v=v, recompute=recompute,
                      launch_kwargs=QUIET).assert_ok()


def _merge(results) -> RunResult:
    """One RunResult from the ranks of a pipeline: the last rank's losses, every stage's parameters."""
    params = {n: t for r in results for n, t in r.params.items()}
    return RunResult(next(r.losses for r in results if r.losses is not None), params)


TORCH_CASES = [("1f1b", 4, 4, 1), ("interleaved", 2, 4, 2), ("zb-v", 4, 8, 2), ("dualpipev", 4, 8, 2)]
_BESIDE_TORCH = {}


def _ours_and_theirs(rank, world_size, recipe, **config):
    return parallel_train(rank, world_size, recipe, **config), torch_pipeline_train(rank, world_size, recipe, **config)


def beside_torch(schedule, p, m, v) -> tuple:
    """(minipar's runs, PyTorch's runs) of one schedule, both in one launch (one start-up instead of two), made
    once per session: test_gpt_schedules_equal_single_device checks the same minipar run against one device."""
    key = (schedule, p, m, v)
    if key not in _BESIDE_TORCH:
        recipe = GPT8 if p * v == 8 else GPT
        out = launch(_ours_and_theirs, p, recipe, schedule=schedule, m=m, v=v, quiet=True)
        _BESIDE_TORCH[key] = [o[0] for o in out], [o[1] for o in out]
    return _BESIDE_TORCH[key]


@pytest.mark.parametrize("schedule,p,m,v", TORCH_CASES)
def test_equals_torch_distributed_pipelining(schedule, p, m, v):
    ours, theirs = beside_torch(schedule, p, m, v)
    # torch divides the summed gradients by m at the end, minipar divides each micro-batch loss: float32
    compare(_merge(theirs), ours, dtype=torch.float32).assert_ok()
    if schedule == "1f1b":       # PyTorch's display list is not the run: chapter 04 sets what ran beside minipar's
        listed, ran = ([a.microbatch for a in acts if a.kind == "F"] for acts in (theirs[-1].order, theirs[-1].executed))
        assert ran == list(range(m)) and listed == [j + 1 for j in ran], (
            f"Schedule1F1B's pipeline_order for the last rank lists forwards {listed}, ran {ran}: PyTorch changed it "
            "(it numbered them one past what ran); its order may now be compared with minipar's lists")
    if schedule in ("zb-v", "dualpipev"):       # the same action lists (torch's F&B pair as its two actions)
        from minipar.pipeline.schedules import make_schedule
        mine = make_schedule(schedule, p, m, v).actions
        assert [t.order for t in theirs] == mine


class ForgetsToAccumulate(PipelineRank):
    """A plausible bug: gradients zeroed between micro-batches, so only the last micro-batch counts."""

    def after_backward(self, stage, mb):
        if mb != self.n_micro - 1:
            for q in self.stages[stage].parameters():
                q.grad = None


def test_the_harness_catches_a_pipeline_that_does_not_accumulate():
    cmp = check_equivalence(parallel_train, 2, MLP, schedule="1f1b", m=4, v=1, rank_class=ForgetsToAccumulate,
                            launch_kwargs=QUIET)
    assert not cmp.matches and cmp.max_abs_diff > 1e-3


def test_timeline_records_every_action_and_the_transfers():
    runs = launch(parallel_train, 2, MLP, schedule="1f1b", m=4, v=1, quiet=True)
    for rank, run in enumerate(runs):
        last = [row for row in run.timeline if row[0] == MLP.steps - 1]
        work = [(k, s, i) for _, k, s, i, _, _ in last if k in ("F", "BW")]
        assert len(work) == 2 * 4 and {s for _, s, _ in work} == {rank}
        assert sum(k == "send" for _, k, *_ in last) == 4          # activations or gradients, one per mb
        assert all(end >= start >= 0 for *_, start, end in last)
        # each rank sent 4 activations (rank 0) or 4 gradients (rank 1) of 3 rows x 8 floats per step
        assert run.bytes_sent == MLP.steps * 4 * 3 * 8 * 4


def test_1f1b_holds_fewer_activations_than_gpipe_and_recomputation_fewer_still():
    from minipar.course.pipeline_views import run_together
    # the three runs in one launch; one step: a step's peak is what is compared, no training is checked
    one_step = gpt_recipe(steps=1, batch_size=8, seq_len=8, n_layer=4, n_embd=16, n_head=2)
    runs = run_together(2, {(schedule, recompute): (one_step, dict(schedule=schedule, m=8, v=1, recompute=recompute,
                                                                   track_memory=True))
                            for schedule, recompute in (("gpipe", False), ("1f1b", False), ("gpipe", True))})
    peak = {key: max(b for _, _, b in r[0].memory) for key, r in runs.items()}    # rank 0: the most in flight
    gpipe, ofob, gpipe_rc = peak["gpipe", False], peak["1f1b", False], peak["gpipe", True]
    assert ofob < 0.6 * gpipe          # 2 of 8 micro-batches in flight instead of 8
    assert gpipe_rc < 0.5 * gpipe      # only stage inputs kept


def _two_pipelines(rank, world_size, recipe):
    """pp=2 x dp=2 with pp outermost: ranks (0, 2) and (1, 3) form two pipelines (the mesh's pp groups),
    each training the whole batch: both must equal one device, and no message may go to rank ± 1."""
    from minipar.mesh import Mesh
    mesh = Mesh(world_size, order=("pp", "dp"), pp=2, dp=2).build(rank)
    assert (mesh.pp_prev, mesh.pp_next) == ((None, rank + 2) if rank < 2 else (rank - 2, None))
    return parallel_train(rank, world_size, recipe, schedule="1f1b", m=4, mesh=mesh)


def test_runtime_uses_the_mesh_pp_groups():
    check_equivalence(_two_pipelines, 4, MLP, launch_kwargs=QUIET).assert_ok()


# -- paced mode: every action held to a fixed slot, so the timeline is the schedule's ----------------------

def test_paced_runs_train_exactly_like_unpaced_ones():
    from minipar.check import train_reference
    from minipar.course.pipeline_views import run_together
    from minipar.pipeline.paced import Pace
    # the three paced runs in one launch, against one reference (the same recipe)
    runs = run_together(2, {"1f1b": (MLP, dict(schedule="1f1b", m=4, v=1, pace=Pace(0.004, 0.004, 0.004))),
                            "zb-h1": (MLP, dict(schedule="zb-h1", m=4, v=1, pace={"min_slot": 0.002})),
                            # the V: a local hand-over has no sender's slot to wait for (PacedRank only paces messages)
                            "zb-v": (MLP, dict(schedule="zb-v", m=4, v=2, pace={"min_slot": 0.002}))})
    reference = train_reference(MLP)
    for key, paced_runs in runs.items():
        assert all(r.pace is not None for r in paced_runs), key
        compare(reference, paced_runs, dtype=MLP.dtype).assert_ok()


@pytest.mark.parametrize("schedule,m,v", [("gpipe", 4, 1), ("interleaved", 4, 2), ("zb-v", 4, 2)])
def test_paced_idle_fraction_is_the_simulators(schedule, m, v):
    """The median over steps of the measured idle within 5 points of the simulator's, slots of 30 ms.

    Pacing holds only while every action fits its slot: a run in which some action overran (the machine
    was too busy: ``PipelineRun.overruns``) and missed is run again, up to three times. A miss without an
    overrun fails at once: then the runtime or the simulator is wrong, not the machine."""
    import statistics

    from minipar.pipeline.paced import Pace
    from minipar.pipeline.runtime import measured_idle_fraction
    from minipar.pipeline.schedules import make_schedule
    from minipar.pipeline.simulate import simulate
    pace = Pace(0.03, 0.015, 0.015)
    recipe = mlp_recipe(steps=3, batch_size=8, sizes=[8] * 5)
    simulated = simulate(make_schedule(schedule, 2, m, v), pace.costs(v)).bubble_fraction
    tries = []
    for _ in range(3):
        runs = launch(parallel_train, 2, recipe, schedule=schedule, m=m, v=v, pace=pace, quiet=True)
        assert runs[0].pace == pace
        measured = statistics.median(measured_idle_fraction(runs, s) for s in range(recipe.steps))
        spans = [(b - a) / pace.slot(k) for _, k, _, _, a, b in runs[0].timeline if k in ("F", "BW")]
        overruns = sum(r.overruns for r in runs)
        tries.append((round(measured, 4), round(statistics.median(spans), 3), overruns))
        if abs(measured - simulated) < 0.05 and 0.9 < statistics.median(spans) < 1.1:   # each action its slot
            return
        assert overruns > 0, f"missed with no action over its slot: (idle, span/slot, overruns) {tries}"
    pytest.fail(f"every try overran its slots (too busy a machine?); simulated idle {simulated:.4f}, "
                f"(idle, span/slot, overruns) per try: {tries}")


def test_pace_is_calibrated_from_unloaded_times_and_checked_before_launch():
    from minipar.pipeline import runtime
    from minipar.pipeline.paced import Pace
    pace = Pace.from_times({"F": 0.001, "BW": 0.004}, margin=4, min_slot=0.01)
    assert (pace.F, pace.B, pace.W, pace.slot("BW")) == (0.01, 0.02, 0.02, 0.04)   # ratios kept, B = W = BW/2
    assert Pace.from_times({"F": 0.01, "B": 0.01, "W": 0.02}, margin=3, min_slot=0.0) == Pace(0.03, 0.03, 0.06)
    for bad in ("fast", {"margin": 0.5}, {"slots": 1}, Pace(0.0, 0.01, 0.01)):
        with pytest.raises(ValueError, match="pace|slot"):
            runtime.run(MLP, world_size=2, schedule="1f1b", m=4, pace=bad)

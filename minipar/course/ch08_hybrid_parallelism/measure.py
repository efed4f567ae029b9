"""Chapter 08's measurements: each layout on 8 ranks (:func:`minipar.course.hybrid_runs.measure_layout`: bytes
per rank per step by kind beside the formulas, observed on the sockets, peak memory, step time, bubble), model
states per GPU from the formula, and what ZeRO-2/3 would cost inside a pipeline (bytes and collective calls per
step, against ZeRO-1 on the same layout)."""
from __future__ import annotations

import torch

from minipar import comm
from minipar.check import compare, train_reference
from minipar.course.hybrid_runs import measure_layout, recipe
from minipar.data.zero import ZeRO
from minipar.data.zero_memory import model_state_bytes_formula
from minipar.hybrid.parallel3d import DEFAULTS, Trainer3D, validate
from minipar.hybrid.runner import parallel_train, run
from minipar.launcher import launch
from minipar.layout import Layout
from minipar.pipeline.runtime import PipelineRank

__all__ = ["recipe", "LAYOUTS", "BAD_LAYOUTS", "measure_layout", "zero_in_pipeline", "zero_once_per_step", "zero_with_pipeline", "layout_runs",
           "layout_memory_formula"]

LAYOUTS = {
    "2x2x2": dict(dp=2, pp=2, tp=2),
    "1x2x4": dict(dp=1, pp=2, tp=4),
    "4x2x1": dict(dp=4, pp=2, tp=1),
    "2x1x4": dict(dp=2, pp=1, tp=4, schedule="gpipe"),
    "2x2x2+sp": dict(dp=2, pp=2, tp=2, sp=True),
    "2x2x2+zero1": dict(dp=2, pp=2, tp=2, zero=1),
    "2x2x2 interleaved v=2": dict(dp=2, pp=2, tp=2, schedule="interleaved", v=2),
}

# §2: layouts ``validate`` refuses before any process starts — heads not divisible by tp, layers not by pp,
# fewer micro-batches than stages under 1F1B, a global batch of 16 not cut by dp × m
BAD_LAYOUTS = [dict(dp=2, pp=2, tp=3, world_size=12, micro_batches=4),
               dict(dp=2, pp=8, tp=1, world_size=16, micro_batches=8),
               dict(dp=2, pp=2, tp=2, world_size=8, micro_batches=1),
               dict(dp=3, pp=2, tp=2, world_size=12, micro_batches=4)]


def layout_memory_formula(psi: float, *, dp: int, pp: int, tp: int, zero: int = 0) -> float:
    """Model-state bytes per GPU: Ψ/(pp·tp) parameters each, optimizer state also /dp under ZeRO-1
    (mixed-precision Adam: 2 + 2 + 12 bytes per parameter, Rajbhandari et al. 2020), by the same library call
    chapters 03 and 12 use (:func:`minipar.data.zero_memory.model_state_bytes_formula`)."""
    return model_state_bytes_formula(psi / (pp * tp), dp, zero)["total"]


class _ZeROPerMicroBatch(PipelineRank):
    """ZeRO-2/3 as a pipeline runs them without ``once_per_step``: the library's :class:`minipar.data.zero.ZeRO`
    on each of this rank's stages (one unit per stage), its gradients reduce-scattered when each micro-batch's
    backward is done (the full gradients may not stay: that is ZeRO-2's memory saving; the shards add up) and,
    under ZeRO-3, the stage's parameters all-gathered before every micro-batch's forward and backward (its
    hooks). Wraps the stages in place: build it on a trainer that is not used afterwards."""

    def __init__(self, *args, dp_group=None, zero: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.zeros = {s: ZeRO(module, None, zero, dp_group, units=[module]) for s, module in self.stages.items()}

    def after_backward(self, stage, mb):
        self.zeros[stage].finish_gradients()     # reduce-scatter what this backward has not reduced yet
        self.zeros[stage].expect_backward()      # and the next micro-batch's gradients again

    def end_step(self) -> None:
        """The step's collectives after the last backward: ZeRO-2 keeps full parameters, so after the optimizer
        updates its shards (local arithmetic, not taken here: only the collectives are counted) it all-gathers
        them (:meth:`minipar.data.zero.ZeRO.step`); ZeRO-3 frees them instead and gathers before the next use."""
        for zero in self.zeros.values():
            if zero.stage == 2:
                for unit in zero.units:
                    unit.refresh_full()


def _zero_pp_rank(rank, world_size, recipe, layout, zero):
    """One step; bytes and calls over the dp group per step (ZeRO-2/3 in the pipeline vs ZeRO-1)."""
    t = Trainer3D(rank, world_size, recipe, **layout, zero=1 if zero == 1 else 0)
    if zero > 1:
        old = t.pipeline
        t.pipeline = _ZeROPerMicroBatch(old.schedule, old.stages, t.mesh, old.shapes, dp_group=t.dp_group,
                                        zero=zero, loss_fn=old.loss_fn)
    log = comm.CommLog()
    inputs, targets = recipe.batches[0]
    if zero == 1:
        t.step(inputs, targets)
        log = t.logs["dp"]
    else:
        from minipar.loop import shard_batch
        x, y = shard_batch((inputs, targets), t.mesh.coord("dp"), t.mesh.size("dp"))
        with comm.recording() as all_:
            t.pipeline.run(list(x.chunk(t.m)), list(y.chunk(t.m)))
            t.pipeline.end_step()
        log.records = [r for r in all_.records if r.op in ("reduce_scatter", "all_gather")]
        log.observed_bytes_sent = None
    return {"bytes": log.bytes_sent, "calls": log.count(), "by_op": log.by_op()}


def zero_in_pipeline(m: int = 4, dp: int = 2, pp: int = 2, tp: int = 2) -> dict:
    """{1, 2, 3: {"bytes", "calls", "by_op"}} over the dp group in one step (rank 0's view; ZeRO-1's counts
    include its all-gather of the updated parameters, ZeRO-2's too, ZeRO-3's the traffic of the step's micro-batches)."""
    layout = dict(dp=dp, pp=pp, tp=tp, micro_batches=m)
    return launch(_zero_pp_ranks, dp * pp * tp, recipe(1), layout, quiet=True)[0]


def _zero_pp_ranks(rank, world_size, recipe, layout):
    """The three variants one after the other in one launch (each builds its own mesh)."""
    return {z: _zero_pp_rank(rank, world_size, recipe, layout, z) for z in (1, 2, 3)}


def zero_once_per_step(m: int = 4, dp: int = 2, pp: int = 2, tp: int = 2, steps: int = 2) -> dict:
    """ZeRO-1/2/3 as the 3D trainer runs them in a pipeline — gathered and reduced once per step, not per
    micro-batch (:class:`minipar.data.zero.ZeRO`'s ``once_per_step``) — checked against one device:
    {zero: {"matches": bool, "calls": collectives over dp per step, "bytes": over dp per step, "between":
    model-state bytes a rank holds between steps, "peak": the step's measured peak}} (rank 0's view)."""
    r = recipe(steps)
    reference = train_reference(r)
    out = {}
    for z in (1, 2, 3):
        runs = run(r, layout=Layout(dp=dp, pp=pp, tp=tp, zero=z, micro_batches=m), track_memory=True)
        out[z] = {"matches": compare(reference, runs, dtype=torch.float64).matches,
                  "calls": runs[0].calls_by_kind["dp"], "bytes": runs[0].bytes_by_kind["dp"],
                  "between": runs[0].model_state_bytes, "peak": runs[0].peak_bytes}
    return out


def _per_microbatch(t, recipe, zero: int) -> dict:
    """ZeRO-2/3 run per micro-batch inside ``t``'s pipeline (:class:`_ZeROPerMicroBatch` swapped in, which wraps
    ``t``'s stages: a trainer of its own): one step's forwards and backwards and, under ZeRO-2, the all-gather
    of the updated shards that ends the step; {"bytes", "calls", "by_op"} of its reduce-scatters and all-gathers
    over dp."""
    from minipar.loop import shard_batch
    old = t.pipeline
    t.pipeline = _ZeROPerMicroBatch(old.schedule, old.stages, t.mesh, old.shapes, dp_group=t.dp_group,
                                    zero=zero, loss_fn=old.loss_fn)
    x, y = shard_batch(recipe.batches[0], t.mesh.coord("dp"), t.mesh.size("dp"))
    with comm.recording() as all_:
        t.pipeline.run(list(x.chunk(t.m)), list(y.chunk(t.m)))
        t.pipeline.end_step()
    t.pipeline = old
    log = comm.CommLog()
    log.records = [r for r in all_.records if r.op in ("reduce_scatter", "all_gather")]
    return {"bytes": log.bytes_sent, "calls": log.count(), "by_op": log.by_op()}


def _zero1_dp_calls(log, steps: int) -> dict:
    """ZeRO-1's reduce-scatters and all-gathers over dp per step, from its run's communication ``log``."""
    dp_calls = comm.CommLog()
    dp_calls.records = [r for r in log.records if r.op in ("reduce_scatter", "all_gather") and r.dims == ("dp",)]
    return {"bytes": dp_calls.bytes_sent // steps, "calls": dp_calls.count() // steps,
            "by_op": {op: (n // steps, b // steps) for op, (n, b) in dp_calls.by_op().items()}}


def _zero_both_ranks(rank, world_size, recipe, layout, zeros=(1, 2, 3)):
    """One launch for §5: ZeRO-``zeros`` once per step over the recipe's steps (peak measured on rank 0, the rank
    the chapter reports; ZeRO-1's calls over dp also kept per op, its first step being what it pays per
    step), then ZeRO-2 and ZeRO-3 run per micro-batch for one step, each in a plain trainer of its own."""
    once, per_mb = {}, {}
    for z in zeros:
        with comm.recording() as log:
            once[z] = parallel_train(rank, world_size, recipe, layout=Layout(**layout, zero=z), track_memory=rank == 0)
        if z == 1:                                  # ZeRO-1's reduce-scatter and all-gather over dp, per step
            per_mb[1] = _zero1_dp_calls(log, len(recipe.batches))
    for z in (2, 3):
        per_mb[z] = _per_microbatch(Trainer3D(rank, world_size, recipe, **layout), recipe, z)
    return per_mb, once


def _layouts_on_rank(rank, world_size, recipe, layouts: dict):
    """§4's layouts ({name: Layout}) one after another in one launch, each tracked as
    :func:`minipar.hybrid.runner.run` tracks it; a ZeRO-1 layout also returns its calls over dp per step
    (:func:`_zero1_dp_calls`), so that §5 reads that same run instead of training it again."""
    out = {}
    for name, layout in layouts.items():
        with comm.recording() as log:
            run_ = parallel_train(rank, world_size, recipe, layout=layout, track_memory=True)
        out[name] = (run_, _zero1_dp_calls(log, len(recipe.batches)) if layout.zero == 1 else None)
    return out


def layout_runs(recipe, names, world_size: int = 8, m: int = 4) -> dict:
    """{name: (per-rank HybridRuns, rank 0's ZeRO-1 calls over dp per step or None)} of the layouts ``names``
    (:data:`LAYOUTS`), 2 steps each in one launch of ``world_size`` ranks (each validated first)."""
    layouts = {name: Layout.of(None, DEFAULTS, micro_batches=m, **LAYOUTS[name]) for name in names}
    for layout in layouts.values():
        validate(recipe, world_size=world_size, layout=layout)
    per_rank = launch(_layouts_on_rank, world_size, recipe, layouts, quiet=True, timeout=120.0)
    return {name: ([r[name][0] for r in per_rank], per_rank[0][name][1]) for name in names}


def zero_with_pipeline(m: int = 4, dp: int = 2, pp: int = 2, tp: int = 2, steps: int = 2, zero1=None) -> dict:
    """§5 in one launch of dp·pp·tp ranks: {"per_microbatch": {1, 2, 3: {"bytes", "calls", "by_op"}} over the dp
    group in one step (ZeRO-1 as the trainer runs it; ZeRO-2/3 reduced, and ZeRO-3 gathered, per micro-batch),
    "once": {1, 2, 3: {"matches", "calls", "bytes", "between", "peak"}} as :func:`zero_once_per_step`} (rank 0's
    view; each once-per-step run compared with one device). ``zero1``: ZeRO-1's run on this layout from
    :func:`layout_runs` (§4's ``2x2x2+zero1``, the same run), which is then not trained again."""
    r = recipe(steps)
    layout = dict(dp=dp, pp=pp, tp=tp, micro_batches=m)
    zeros = (1, 2, 3) if zero1 is None else (2, 3)
    out = launch(_zero_both_ranks, dp * pp * tp, r, layout, zeros, quiet=True, timeout=120.0)
    reference = train_reference(r)
    once, per_mb = {}, dict(out[0][0])
    if zero1 is not None:
        zero1_runs, per_mb[1] = zero1
    for z in (1, 2, 3):
        runs = zero1_runs if z not in zeros else [o[1][z] for o in out]
        once[z] = {"matches": compare(reference, runs, dtype=torch.float64).matches,
                   "calls": runs[0].calls_by_kind["dp"], "bytes": runs[0].bytes_by_kind["dp"],
                   "between": runs[0].model_state_bytes, "peak": runs[0].peak_bytes}
    return {"per_microbatch": dict(sorted(per_mb.items())), "once": once}


def one_t_as_chapter_12_prices_it():
    """The 1T run of §4 as chapter 12b's planner prices it, with chapter 12's inputs
    (``ch12_choosing_a_strategy.report.oneflow_layout``): Narayanan et al. 2021's Table 1 model, TP 8 · PP 64 ·
    DP 6 on 384 DGX A100 nodes, 512 micro-batches of 1, full recomputation. Returns :func:`minipar.plan.estimate`'s
    result (``bytes_sent``, ``time``, ``step_seconds``)."""
    from minipar.plan import NARAYANAN_1T, Layout as PlanLayout, a100_cluster, estimate
    layout = PlanLayout(dp=6, tp=8, pp=64, micro_batch=1, micro_batches=512, recompute="full")
    return estimate(NARAYANAN_1T, a100_cluster(384), layout)

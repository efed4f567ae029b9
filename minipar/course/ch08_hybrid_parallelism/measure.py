"""Chapter 08's measurements: each layout on 8 ranks, the 5D one on 16 (bytes per rank per step by kind beside
the formulas, observed on the sockets, peak memory, step time, bubble), the OneFlow article's layout (GPT-3's, it says; the 1T model's, in fact) from the formulas, and what ZeRO-2/3
would cost inside a pipeline (bytes and collective calls per step, against ZeRO-1 on the same layout)."""
from __future__ import annotations

import statistics

import torch

from minipar import comm
from minipar.check import RunResult, compare, gpt_recipe, train_reference
from minipar.data.zero import ZeRO
from minipar.hybrid.parallel3d import Trainer3D, bytes_formula, validate
from minipar.hybrid.runner import parallel_train, run
from minipar.pipeline.runtime import PipelineRank
from minipar.launcher import launch
from minipar.layout import Layout
from minipar.pipeline.timeline import measured_idle_fraction
from minipar.pipeline.schedules import bubble_formula
from minipar.activations import activation_bytes_formula

__all__ = ["recipe", "LAYOUTS", "LAYOUTS_16", "measure_layout", "seed_layout", "SEED_001_MODELS", "zero_in_pipeline", "zero_once_per_step", "zero_with_pipeline",
           "layout_memory_formula"]

BATCH, SEQ = 16, 8


def recipe(steps: int = 3):
    """The chapter's recipe: tiny GPT (4 layers, hidden 32, 4 heads), Adam, global batch 16 × 8 tokens, float64."""
    r = gpt_recipe(steps=steps, batch_size=BATCH, seq_len=SEQ, n_layer=4)
    r.dtype = torch.float64
    return r


LAYOUTS = {
    "2x2x2": dict(dp=2, pp=2, tp=2),
    "1x2x4": dict(dp=1, pp=2, tp=4),
    "4x2x1": dict(dp=4, pp=2, tp=1),
    "2x1x4": dict(dp=2, pp=1, tp=4, schedule="gpipe"),
    "2x2x2+sp": dict(dp=2, pp=2, tp=2, sp=True),
    "2x2x2+zero1": dict(dp=2, pp=2, tp=2, zero=1),
    "2x2x2 interleaved v=2": dict(dp=2, pp=2, tp=2, schedule="interleaved", v=2),
}
# 16 ranks, apart from the 8-rank LAYOUTS (the chapter's memory figure runs those on 8): the tour's 5d row
LAYOUTS_16 = {"2x2x2x2 dp pp cp tp": dict(dp=2, pp=2, cp=2, tp=2, cp_method="ring-zigzag")}


def _logged_rank(rank, world_size, recipe, layout):
    """:func:`parallel_train`, with every call of its steps also kept: (its HybridRun, {dims spanned: observed
    bytes per step, or None where a call is asynchronous — isend/irecv's bytes leave after they return})."""
    with comm.recording() as log:                      # no mesh here: only the step's own logs name dims
        result = parallel_train(rank, world_size, recipe, layout=layout, track_memory=True)
    observed: dict = {}
    for rec in log.records:
        if rec.dims is not None:                       # a step's call (not the clock's broadcast, the gather)
            seen = observed.get(rec.dims, 0)
            observed[rec.dims] = None if seen is None or rec.observed_sent is None else seen + rec.observed_sent
    steps = len(recipe.batches)
    return result, {dims: None if b is None else b / steps for dims, b in observed.items()}


def measure_layout(layout: dict, steps: int = 3, m: int = 4, reference: RunResult | None = None) -> dict:
    """Run ``layout`` on its ranks (8; 16 with cp = 2); return its comparison with one device and its
    measurements (mean over ranks of bytes per step by kind, formula beside; observed per window and per
    dims spanned where the calls block; max peak and model states; median step time; one pipeline's bubble)."""
    r, shape = recipe(steps), Layout(**layout, micro_batches=m)
    validate(r, layout=shape)
    logged = launch(_logged_rank, shape.world_size, r, shape, quiet=True, timeout=120.0)
    runs = [x for x, _ in logged]
    c = compare(reference or train_reference(r), runs, dtype=r.dtype)
    cfg = r.model().cfg
    formulas = [bytes_formula(cfg, batch=BATCH, seq=SEQ, layout=shape, pp_rank=x.coords["pp"]) for x in runs]
    mean = lambda xs: sum(xs) / len(xs)                                          # noqa: E731
    one_pipeline = [x for x in runs if all(c == 0 for d, c in x.coords.items() if d != "pp")]   # dp = tp = 0
    sched, p, v = layout.get("schedule", "1f1b"), layout["pp"], layout.get("v", 1)
    kinds = list(formulas[0])                                                    # dp, pp, tp (+ cp)
    return {
        "matches": c.matches, "max_abs_diff": c.max_abs_diff,
        "bytes": {k: mean([x.bytes_by_kind[k] for x in runs]) for k in kinds},
        "formula": {k: mean([f[k] for f in formulas]) for k in kinds},
        "observed": {k: mean([x.observed[k] for x in runs]) for k in ("dp", "pp+tp")},
        "observed_by_dims": {d: None if None in (o.get(d) for _, o in logged) else mean([o[d] for _, o in logged])
                             for d in logged[0][1]},
        "calls": {k: mean([x.calls_by_kind[k] for x in runs]) for k in kinds},
        "peak_bytes": max(x.peak_bytes for x in runs),
        "model_state_bytes": max(x.model_state_bytes for x in runs),
        "step_seconds": statistics.median(s for x in runs for s in x.step_seconds[1:]),
        "bubble": measured_idle_fraction(one_pipeline) if p > 1 else 0.0,
        "bubble_formula": bubble_formula(sched, p, m, v) if p > 1 else 0.0,
        "runs": runs,
    }


def layout_memory_formula(psi: float, *, dp: int, pp: int, tp: int, zero: int = 0,
                          bytes_param: int = 2, bytes_grad: int = 2, bytes_optim: int = 12) -> float:
    """Model-state bytes per GPU: Ψ/(pp·tp) parameters each, optimizer state also /dp under ZeRO-1
    (mixed-precision Adam: 2 + 2 + 12 bytes per parameter, Rajbhandari et al. 2020)."""
    per_gpu = psi / (pp * tp)
    return per_gpu * (bytes_param + bytes_grad + bytes_optim / (dp if zero >= 1 else 1))


# (layers, hidden, heads, sequence, global batch in sequences, parameters)
SEED_001_MODELS = {
    "GPT-3 175B": (96, 12288, 96, 2048, 1536, 175e9),          # Brown et al. 2020 (3.2M tokens per batch)
    "1T": (128, 25600, 160, 2048, 3072, 1008e9),               # Narayanan et al. 2021, Table 1, last row
}


def seed_layout(model: str = "1T", m: int | None = None, recompute: bool = True) -> dict:
    """A model of :data:`SEED_001_MODELS` on the OneFlow article's layout: 64 pipeline stages × 6 hosts in data parallel ×
    8 GPUs in model parallel = 3072 GPUs (the layout of Narayanan et al.'s 1T row, which the seed calls
    GPT-3's). ``m`` micro-batches per replica (default: micro-batch of one sequence). Formulas, not a run."""
    layers, h, a, s, batch, psi = SEED_001_MODELS[model]
    pp, dp, tp = 64, 6, 8
    m = m or batch // dp
    per_stage_max = -(-layers // pp)                         # 96 layers on 64 stages: some get 2, some 1
    psi_layer = 12 * h * h
    mb = batch // (dp * m)
    act_layer = activation_bytes_formula(s, mb, h, a, t=tp)     # Korthikanti et al., 16-bit, TP without SP
    in_flight = pp                                           # 1F1B: stage 0 holds p micro-batches
    act = in_flight * per_stage_max * (2 * s * mb * h if recompute else act_layer)
    states = per_stage_max * psi_layer / tp * 16
    return {"gpus": pp * dp * tp, "layers_per_stage": (layers / pp, per_stage_max), "micro_batch": mb, "m": m,
            "model_states_per_gpu": states,
            "model_states_per_gpu_zero1": per_stage_max * psi_layer / tp * (4 + 12 / dp),
            "activations_per_gpu": act, "bubble": bubble_formula("1f1b", pp, m), "psi": psi,
            "even_split_states": layout_memory_formula(psi, dp=dp, pp=pp, tp=tp)}


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
        log.records = [r for r in all_.records if r.op in ("reduce_scatter", "all_gather")]
        log.observed_bytes_sent = None
    return {"bytes": log.bytes_sent, "calls": log.count(), "by_op": log.by_op()}


def zero_in_pipeline(m: int = 4, dp: int = 2, pp: int = 2, tp: int = 2) -> dict:
    """{1, 2, 3: {"bytes", "calls", "by_op"}} over the dp group in one step (rank 0's view; ZeRO-1's counts
    include its all-gather of the updated parameters, ZeRO-2/3's the traffic of the step's micro-batches)."""
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
    ``t``'s stages: a trainer of its own): one step's forward and backward; {"bytes", "calls", "by_op"} of its
    reduce-scatters and all-gathers over dp."""
    from minipar.loop import shard_batch
    old = t.pipeline
    t.pipeline = _ZeROPerMicroBatch(old.schedule, old.stages, t.mesh, old.shapes, dp_group=t.dp_group,
                                    zero=zero, loss_fn=old.loss_fn)
    x, y = shard_batch(recipe.batches[0], t.mesh.coord("dp"), t.mesh.size("dp"))
    with comm.recording() as all_:
        t.pipeline.run(list(x.chunk(t.m)), list(y.chunk(t.m)))
    t.pipeline = old
    log = comm.CommLog()
    log.records = [r for r in all_.records if r.op in ("reduce_scatter", "all_gather")]
    return {"bytes": log.bytes_sent, "calls": log.count(), "by_op": log.by_op()}


def _zero_both_ranks(rank, world_size, recipe, layout):
    """One launch for §5: ZeRO-1/2/3 once per step over the recipe's steps (peak measured on rank 0, the rank
    the chapter reports; ZeRO-1's calls over dp also kept per op, its first step being what it pays per
    step), then ZeRO-2 and ZeRO-3 run per micro-batch for one step, each in a plain trainer of its own."""
    once, per_mb = {}, {}
    for z in (1, 2, 3):
        with comm.recording() as log:
            once[z] = parallel_train(rank, world_size, recipe, layout=Layout(**layout, zero=z), track_memory=rank == 0)
        if z == 1:                                  # ZeRO-1's reduce-scatter and all-gather over dp, per step
            dp_calls = comm.CommLog()
            dp_calls.records = [r for r in log.records if r.op in ("reduce_scatter", "all_gather") and r.dims == ("dp",)]
            steps = len(recipe.batches)
            per_mb[1] = {"bytes": dp_calls.bytes_sent // steps, "calls": dp_calls.count() // steps,
                         "by_op": {op: (n // steps, b // steps) for op, (n, b) in dp_calls.by_op().items()}}
    for z in (2, 3):
        per_mb[z] = _per_microbatch(Trainer3D(rank, world_size, recipe, **layout), recipe, z)
    return per_mb, once


def zero_with_pipeline(m: int = 4, dp: int = 2, pp: int = 2, tp: int = 2, steps: int = 2) -> dict:
    """§5 in one launch of dp·pp·tp ranks: {"per_microbatch": {1, 2, 3: {"bytes", "calls", "by_op"}} over the dp
    group in one step (ZeRO-1 as the trainer runs it; ZeRO-2/3 reduced, and ZeRO-3 gathered, per micro-batch),
    "once": {1, 2, 3: {"matches", "calls", "bytes", "between", "peak"}} as :func:`zero_once_per_step`} (rank 0's
    view; each once-per-step run compared with one device)."""
    r = recipe(steps)
    layout = dict(dp=dp, pp=pp, tp=tp, micro_batches=m)
    out = launch(_zero_both_ranks, dp * pp * tp, r, layout, quiet=True, timeout=120.0)
    reference = train_reference(r)
    once = {}
    for z in (1, 2, 3):
        runs = [o[1][z] for o in out]
        once[z] = {"matches": compare(reference, runs, dtype=torch.float64).matches,
                   "calls": runs[0].calls_by_kind["dp"], "bytes": runs[0].bytes_by_kind["dp"],
                   "between": runs[0].model_state_bytes, "peak": runs[0].peak_bytes}
    return {"per_microbatch": dict(sorted(out[0][0].items())), "once": once}

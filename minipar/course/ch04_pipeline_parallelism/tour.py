"""Chapter 04 in the tour: pipeline schedules on 4 ranks.

Each row trains the tiny GPT (8 layers, hidden 16, 2 heads, sequence 8, global batch 16 cut into m = 8
micro-batches of 2, Adam, 2 steps, float64) with :func:`minipar.pipeline.runtime.parallel_train` and
compares the loss at every step and every parameter with one device (harness float64 tolerance: the
micro-batch gradients are summed in another order, which Adam in float32 can amplify for weights whose
gradient is nearly zero). Bytes: what one rank sends per step (mean over ranks,
from the communication log) next to the formula 2 · c · m · A / p, A = one micro-batch's
activation (2 · 8 · 16 · 8 B), c the stage boundaries that cross ranks (p·v - 1; 2p - 2 in the V of ZB-V and
DualPipeV, whose turn stays on rank p-1): each carries each micro-batch's activation forward and its
gradient back; beside it, what the sockets carried in one step (:mod:`minipar.observe.wire`: a run of 2 steps minus a
run of 1, so that setup cancels). Peak: live bytes created during a step (activations, gradients, buffers), max over ranks,
measured with :class:`minipar.memory.LiveTensorTracker`. The PipeDream rows are compared with their own
update rules (they are not synchronous training) and train with SGD for 6 steps.
"""
from __future__ import annotations

import functools

import torch

from minipar import comm
from minipar.check import compare, gpt_recipe, train_reference
from minipar.launcher import launch
from minipar.pipeline import pipedream, runtime
from minipar.pipeline.pipedream import reference_2bw, reference_async
from minipar.pipeline.simulate import simulate
from minipar.pipeline.schedules import make_schedule
from minipar.course.tour import WORLD_SIZE, TourRow

M, BATCH, SEQ, HIDDEN = 8, 16, 8, 16
ACT_BYTES = (BATCH // M) * SEQ * HIDDEN * 8             # float64


def _recipe(optimizer="adam", steps=2):
    recipe = gpt_recipe(steps=steps, batch_size=BATCH, seq_len=SEQ, n_layer=8, n_embd=HIDDEN, n_head=2,
                        optimizer=optimizer)
    recipe.dtype = torch.float64
    return recipe


def _bytes_formula(sched):
    """2 · c · m · A / p, c the stage boundaries whose two stages sit on different ranks (p·v − 1 round-robin,
    2p − 2 in a V, whose turn stays on rank p−1): read off the schedule's own placement."""
    crossings = sum(sched.rank_of(s) != sched.rank_of(s + 1) for s in range(sched.num_stages - 1))
    return 2 * crossings * sched.m * ACT_BYTES / sched.p


def _observed_rank(rank, world_size, recipe, short, **config):
    """The run, and one step's bytes on the wire: observed(all steps) - observed(one step fewer), so that
    what both runs share (process groups, clock sync, gathering the results) cancels."""
    seen = []
    for r in (short, recipe):
        with comm.recording() as log:
            run = runtime.parallel_train(rank, world_size, r, **config)
        seen.append(log.observed_bytes_sent)
    return run, None if None in seen else seen[1] - seen[0], log.count() / recipe.steps


def _schedule_row(schedule: str, v: int = 1, recompute: bool = False) -> TourRow:
    recipe, short = _recipe(), _recipe(steps=1)
    runtime.validate(recipe, world_size=WORLD_SIZE, schedule=schedule, m=M, v=v)
    out = launch(_observed_rank, WORLD_SIZE, recipe, short, schedule=schedule, m=M, v=v, recompute=recompute,
                 track_memory=True, quiet=True)
    runs = [o[0] for o in out]
    cmp = compare(train_reference(recipe), runs, dtype=recipe.dtype)
    sent = sum(r.bytes_sent for r in runs) / len(runs) / recipe.steps
    observed = None if any(o[1] is None for o in out) else sum(o[1] for o in out) / len(out)
    peak = max(b for r in runs for _, _, b in r.memory)
    sched = make_schedule(schedule, WORLD_SIZE, M, v)
    bubble = simulate(sched).bubble_fraction
    name = {"1f1b": "1F1B (PipeDream-Flush)", "gpipe": "GPipe", "interleaved": f"interleaved 1F1B, v={v}",
            "zb-h1": "zero bubble ZB-H1", "naive": "naive model parallel", "zb-v": "zero bubble ZB-V (V placement)",
            "dualpipev": "DualPipeV (V placement, F&B pairs run in turn)"}[schedule]
    return TourRow(strategy=f"pipeline {name}{' + recompute' if recompute else ''}, pp={WORLD_SIZE}, m={M}",
                   world_size=WORLD_SIZE, matches=cmp.matches, max_abs_diff=cmp.max_abs_diff,
                   bytes_sent_per_rank=sent, bytes_formula=_bytes_formula(sched),
                   peak_bytes_per_rank=peak,
                   note=f"bytes per step (observed: the {recipe.steps}-step run minus a 1-step run, so setup "
                        f"cancels; gloo frames each of the small activation messages); simulated bubble "
                        f"{bubble:.3f}",
                   bytes_observed_per_rank=observed, calls_per_rank=sum(o[2] for o in out) / len(out))


def _pipedream_rank(rank, world_size, recipe, short, **config):
    """The run, and one batch's bytes (log and wire): the run minus a run of one batch fewer."""
    seen = []
    for r in (short, recipe):
        with comm.recording() as log:
            run = pipedream.parallel_train(rank, world_size, r, **config)
        seen.append((log.bytes_sent, log.observed_bytes_sent, log.count()))
    (m0, o0, c0), (m1, o1, c1) = seen
    return run, m1 - m0, None if None in (o0, o1) else o1 - o0, c1 - c0


def _pipedream_row(mode: str) -> TourRow:
    recipe, short = _recipe("sgd", steps=6), _recipe("sgd", steps=5)
    pipedream.validate(recipe, world_size=WORLD_SIZE, mode=mode, m=M)
    pipedream.validate(short, world_size=WORLD_SIZE, mode=mode, m=M)
    out = launch(_pipedream_rank, WORLD_SIZE, recipe, short, mode=mode, m=M, lr=0.1, quiet=True)
    runs = [o[0] for o in out]
    rule = reference_2bw(recipe, 0.1) if mode == "2bw" else reference_async(recipe, WORLD_SIZE, 0.1)
    cmp = compare(rule, runs, dtype=recipe.dtype)
    name = "PipeDream-2BW" if mode == "2bw" else "PipeDream async + weight stashing"
    versions = [r.most_versions for r in runs]
    m = M if mode == "2bw" else 1                       # async: every batch is one input
    formula = 2 * (WORLD_SIZE - 1) * m * (BATCH // m) * SEQ * HIDDEN * 8 / WORLD_SIZE
    mean = lambda i: sum(o[i] for o in out) / len(out)  # noqa: E731
    observed = None if any(o[2] is None for o in out) else mean(2)
    return TourRow(strategy=f"pipeline {name}, pp={WORLD_SIZE}", world_size=WORLD_SIZE, matches=cmp.matches,
                   max_abs_diff=cmp.max_abs_diff, bytes_sent_per_rank=mean(1), bytes_formula=formula,
                   peak_bytes_per_rank=None,
                   note=f"compared with its update rule, not with synchronous training; weight versions "
                        f"held per rank {versions}; bytes per batch (a 6-batch run minus a 5-batch run), "
                        f"formula 2(p-1)·(batch activation)/p as for 1F1B",
                   kind="update rule", bytes_observed_per_rank=observed, calls_per_rank=mean(3))


STRATEGIES = [
    ("pipeline GPipe", functools.partial(_schedule_row, "gpipe")),
    ("pipeline GPipe + recompute", functools.partial(_schedule_row, "gpipe", recompute=True)),
    ("pipeline 1F1B", functools.partial(_schedule_row, "1f1b")),
    ("pipeline interleaved 1F1B", functools.partial(_schedule_row, "interleaved", 2)),
    ("pipeline zero bubble ZB-H1", functools.partial(_schedule_row, "zb-h1")),
    ("pipeline ZB-V", functools.partial(_schedule_row, "zb-v", 2)),
    ("pipeline DualPipeV", functools.partial(_schedule_row, "dualpipev", 2)),
    ("pipeline PipeDream-2BW", functools.partial(_pipedream_row, "2bw")),
    ("pipeline PipeDream async", functools.partial(_pipedream_row, "async")),
]

"""Appendix A's step model, and this machine calibrated for it: what ``bench calibrate`` and ``bench replay``
train, and the α-β links, FLOP/s and optimizer cost the planner is given to predict it.

* :data:`STEP_CONFIG` / :func:`step_layouts`: one model (4 layers, h = 128, 16 sequences of 64 tokens) and the
  eight strategies that train it on n ranks (:func:`train`), with the planner's options for it
  (:func:`planner_options`);
* :func:`calibrate` fits the α-β model of one message (send/recv between 2 ranks, sizes from 1 KiB to 4 MiB,
  :func:`minipar.observe.measure.pingpong`, t = α + S/β) and measures, on n ranks at once (they share the
  cores), a rank's forward + backward FLOP/s, the optimizer's seconds per parameter, a 4-byte all-reduce, and
  gloo's all-reduce, all-gather and reduce-scatter at four sizes each (:func:`collective_times`,
  :func:`minipar.observe.measure.time_calls`), fitted per op (:func:`allreduce_link`, :func:`op_links`);
  :func:`calibrated_cluster` is the machine as the planner's :class:`minipar.plan.Cluster`.
"""
from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from minipar.check import gpt_recipe
from minipar.data import ddp, zero
from minipar.launcher import launch
from minipar.models import GPTConfig, TinyGPT
from minipar.observe.measure import LINK_OPS, fit_links, fit_p2p, flops_per_second, pingpong, time_calls, wall_seconds
from minipar.pipeline import runtime
from minipar.plan import Cluster, Layout, Transformer, model_flops, parameters
from minipar.tensor import gpt

__all__ = ["STEP_CONFIG", "STEP_BATCH", "STEP_SEQ", "STEP_M", "STEP_MODEL", "STEP_RANKS", "step_layouts",
           "step_recipe", "train", "planner_options", "ALLREDUCE_SIZES", "COLLECTIVE_REPEATS", "calibrate",
           "collective_times", "allreduce_link", "op_links", "calibrated_cluster", "training_flops_per_second"]

# ---------------------------------------------------------------------------------------------------------
# The step model and its strategies
# ---------------------------------------------------------------------------------------------------------

STEP_CONFIG = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=64)
STEP_BATCH, STEP_SEQ, STEP_M = 16, 64, 8
STEP_MODEL = Transformer.from_config(STEP_CONFIG, STEP_SEQ)
# one rank per core, as one rank per GPU (more ranks than cores adds the scheduler's waits, which the model
# of devices that do not share has no term for), at least 2, at most 4
STEP_RANKS = max(2, min(4, os.cpu_count() or 2))


def step_layouts(n: int = STEP_RANKS) -> dict:
    """{name: the Layout estimate() costs} on n ranks: global batch 16 sequences of 64 tokens, float32 Adam."""
    return {
        "DDP": Layout(dp=n, micro_batch=STEP_BATCH // n),
        "ZeRO-1": Layout(dp=n, micro_batch=STEP_BATCH // n, zero=1),
        "ZeRO-2": Layout(dp=n, micro_batch=STEP_BATCH // n, zero=2),
        "ZeRO-3": Layout(dp=n, micro_batch=STEP_BATCH // n, zero=3),
        "GPipe": Layout(pp=n, schedule="gpipe", micro_batch=STEP_BATCH // STEP_M, micro_batches=STEP_M),
        "1F1B": Layout(pp=n, micro_batch=STEP_BATCH // STEP_M, micro_batches=STEP_M),
        "TP": Layout(tp=n, micro_batch=STEP_BATCH),
        "TP + SP": Layout(tp=n, sp=True, micro_batch=STEP_BATCH),
    }


def step_recipe(steps: int):
    """The step model's recipe: ``steps`` steps of 16 sequences of 64 tokens, float32 Adam."""
    c = STEP_CONFIG
    return gpt_recipe(steps=steps, batch_size=STEP_BATCH, seq_len=STEP_SEQ, n_layer=c.n_layer, n_embd=c.n_embd,
                      n_head=c.n_head, vocab_size=c.vocab_size, block_size=c.block_size)


def train(rank, world_size, name, recipe):
    """Train ``recipe`` with the library's strategy ``name`` (a key of :func:`step_layouts`)."""
    if name == "DDP":
        ddp.parallel_train(rank, world_size, recipe)
    elif name.startswith("ZeRO-"):
        zero.parallel_train(rank, world_size, recipe, stage=int(name[-1]))
    elif name in ("GPipe", "1F1B"):
        runtime.parallel_train(rank, world_size, recipe, schedule=name.lower(), m=STEP_M)
    else:
        gpt.parallel_train(rank, world_size, recipe, sequence_parallel=name == "TP + SP")


def planner_options(layout) -> dict:
    """:func:`estimate`'s options for the step model as this course trains it: float32, no dropout, DDP's
    25 MiB buckets; this course's ZeRO reduces one unit (a block, or the rest of the model) at a time."""
    per_unit = 4 * parameters(STEP_MODEL) / (STEP_CONFIG.n_layer + 1) * 1.001
    return dict(precision="fp32", dropout=False, bucket_bytes=per_unit if layout.zero else 25 * 2 ** 20)


# ---------------------------------------------------------------------------------------------------------
# Calibration: α, β of the links between ranks, FLOP/s of one rank
# ---------------------------------------------------------------------------------------------------------

def training_flops_per_second(steps: int = 3, ranks: int = 4) -> float:
    """Effective FLOP/s of one thread, alone on the machine, training the step model (model FLOPs of a
    step / its time, best of ``steps``, optimizer included): the old calibration, kept for comparison."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt, x, y, loss = _local_step_model(ranks)
        step = lambda: (opt.zero_grad(), loss(model, x, y).backward(), opt.step())  # noqa: E731
        step()
        best = min(wall_seconds(step) for _ in range(steps))
    finally:
        torch.set_num_threads(threads)
    return model_flops(STEP_MODEL, STEP_BATCH // ranks) / best


def _local_step_model(ranks: int):
    """(model, optimizer, x, y, loss) of one rank's 1/ranks of a step-model batch, no parallelism."""
    c = STEP_CONFIG
    recipe = gpt_recipe(steps=1, batch_size=STEP_BATCH // ranks, seq_len=STEP_SEQ, n_layer=c.n_layer,
                        n_embd=c.n_embd, n_head=c.n_head, vocab_size=c.vocab_size, block_size=c.block_size)
    model = TinyGPT(STEP_CONFIG)
    x, y = recipe.batches[0]
    return model, recipe.optimizer(model.parameters()), x, y, recipe.loss


def _contended(rank, world_size, repeats):
    """On every rank at once (the ranks share the cores, as in a real run): the FLOP/s of a forward and
    backward of a 1/n batch, the seconds of one Adam step per parameter, and a 4-byte all-reduce on
    all ranks — each the least disturbed of ``repeats`` (after a warm-up) — and gloo's collectives at
    :data:`ALLREDUCE_SIZES` (:func:`collective_times`: their mean)."""
    model, opt, x, y, loss = _local_step_model(world_size)
    n = sum(p.numel() for p in model.parameters())
    fb, adam, small = [], [], []
    tiny = torch.zeros(1)
    for i in range(repeats + 1):
        dist.barrier()
        opt.zero_grad()
        fb.append(wall_seconds(lambda: loss(model, x, y).backward()))
        adam.append(wall_seconds(opt.step))
        dist.barrier()
        small.append(wall_seconds(lambda: dist.all_reduce(tiny)))
    least = lambda v: min(v[1:])  # noqa: E731
    out = {"flops": model_flops(STEP_MODEL, STEP_BATCH // world_size) / least(fb),
           "optimizer_s_per_param": least(adam) / n, "allreduce_small_s": least(small)}
    out.update(collective_times(world_size))
    return out


def collective_times(world_size: int, repeats: int | None = None) -> dict:
    """On every rank at once: {"<op>_<bytes>_s": the mean seconds of ``repeats`` (default
    :data:`COLLECTIVE_REPEATS`) calls of gloo's all-reduce ("allreduce", the key it always had), all-gather
    and reduce-scatter of :data:`ALLREDUCE_SIZES` bytes, each call after a barrier
    (:func:`minipar.observe.measure.time_calls`), "<op>_<bytes>_median_s": their median}.

    The mean, not the median: here a call's time has two modes (a few hundred µs, or ~2 ms when a rank's
    blocked threads are woken late: a quarter to a half of the calls), and a step pays the sum of its calls —
    the expected call, not the typical one."""
    times = time_calls(world_size, ALLREDUCE_SIZES, repeats or COLLECTIVE_REPEATS)
    out = {}
    for size in ALLREDUCE_SIZES:
        for op in LINK_OPS:
            out[f"{_KEYS[op]}_{size}_s"] = statistics.fmean(times[op][size])
            out[f"{_KEYS[op]}_{size}_median_s"] = statistics.median(times[op][size])
    return out


ALLREDUCE_SIZES = (4, 2 ** 16, 2 ** 19, 2 ** 21)       # bytes of the collectives calibrate() times
COLLECTIVE_REPEATS = 60            # calls per op and size: the mean of a two-mode time settles to ~10 %
_KEYS = {"all_reduce": "allreduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}  # f"{key}_{bytes}_s"
_TIMED_OPS = tuple(f"{key}_" for key in _KEYS.values())


def _timed_sizes(cal: dict, op: str) -> dict:
    """{bytes: mean seconds} of ``op`` in a calibration (the sizes it has)."""
    return {size: cal[f"{_KEYS[op]}_{size}_s"] for size in ALLREDUCE_SIZES if f"{_KEYS[op]}_{size}_s" in cal}


def allreduce_link(cal: dict, devices: int):
    """(β, α) of one ring step fitted to gloo's own all-reduce on ``devices`` ranks, t = 2(n-1)·α +
    2(n-1)/n · S/β (least squares in relative error over :data:`ALLREDUCE_SIZES`); None if not measured."""
    links = fit_links({"all_reduce": _timed_sizes(cal, "all_reduce")}, devices)
    return None if links is None else links.ops["all_reduce"]


def op_links(cal: dict, devices: int):
    """:class:`minipar.machine.fidelity.OpLinks` of this machine: each collective gloo was timed doing (all-reduce,
    all-gather, reduce-scatter; :data:`ALLREDUCE_SIZES`) on its own fitted α, β (:func:`minipar.observe.measure.
    fit_links`), send/recv on the ping-pong's α, β. None where ``cal`` has no per-op timings."""
    p2p = (cal["p2p_beta"], cal["p2p_alpha"]) if "p2p_beta" in cal else (cal["beta"], cal["alpha"])
    return fit_links({op: _timed_sizes(cal, op) for op in LINK_OPS}, devices, p2p)


def calibrate(sizes=(2 ** 10, 2 ** 14, 2 ** 18, 2 ** 20, 2 ** 22), repeats: int = 9, ranks: int | None = None) -> dict:
    """Measured on this machine: {"alpha": s, "beta": bytes/s (send/recv between 2 ranks, the fastest round
    trips: the link undisturbed), "p2p_alpha", "p2p_beta" (the same fitted to the mean round trip: what a
    message costs a program on average), "flops": FLOP/s of one rank's forward + backward while all ``ranks``
    (default :data:`STEP_RANKS`) compute, "optimizer_s_per_param": one Adam step, seconds per parameter (the
    same way), "allreduce_small_s": a 4-byte all-reduce on all ranks (latency alone), "<op>_<bytes>_s":
    gloo's all-reduce, all-gather and reduce-scatter of :data:`ALLREDUCE_SIZES` bytes on all ranks (the mean
    of :data:`COLLECTIVE_REPEATS` calls; "<op>_<bytes>_median_s" their median), "alone_flops": one thread
    training alone (optimizer included), "matmul_flops": a bare matmul on one thread, "ranks", "samples":
    {bytes: s} (the fastest one-way times)}."""
    samples = pingpong(sizes, max(repeats, COLLECTIVE_REPEATS))
    times = {size: min(v) for size, v in samples.items()}            # min: the least disturbed by others
    beta, alpha = fit_p2p(times)
    p2p_beta, p2p_alpha = fit_p2p({size: statistics.fmean(v) for size, v in samples.items()})
    n = ranks or STEP_RANKS
    ranks = launch(_contended, n, repeats, quiet=True)
    mean = lambda k: sum(r[k] for r in ranks) / len(ranks)  # noqa: E731
    return {"alpha": alpha, "beta": beta, "p2p_alpha": p2p_alpha, "p2p_beta": p2p_beta,
            "flops": mean("flops"),
            "optimizer_s_per_param": mean("optimizer_s_per_param"), "allreduce_small_s": mean("allreduce_small_s"),
            **{k: mean(k) for k in ranks[0] if k.startswith(_TIMED_OPS) and k != "allreduce_small_s"},
            "alone_flops": training_flops_per_second(ranks=n), "matmul_flops": flops_per_second(), "ranks": n,
            "samples": times}


def calibrated_cluster(cal: dict, devices: int | None = None, contended: bool = True) -> Cluster:
    """The machine as a cluster of ``devices`` ranks (one node, every link the measured α, β).

    ``contended=True``: a rank's FLOP/s and optimizer cost as measured while all ranks compute at once
    (what they share — cores, caches, whatever else runs — is in the measurement), and the links as gloo's
    own all-reduce runs over them (:func:`allreduce_link`: timed at a few sizes on all ranks, the median,
    fitted — a collective pays gloo's algorithm and its threads' wake-ups, which a ping-pong between two
    waiting ranks does not). Without those timings: the ping-pong's β, and a ring step's latency from a
    4-byte all-reduce, t / 2(n-1), when that exceeds the ping-pong α. ``False``: the first
    calibration, kept to show why it missed: one thread alone, scaled by the share of cores a rank gets,
    min(1, cores / ranks), with the optimizer inside its FLOP/s."""
    devices = devices or cal.get("ranks", 4)
    if not contended:
        share = min(1.0, (os.cpu_count() or 1) / devices)
        return Cluster(devices, 1, 16e9, cal["alone_flops"] * share, cal["beta"], cal["beta"], cal["alpha"],
                       cal["alpha"])
    fitted = allreduce_link(cal, devices)
    if fitted is not None:          # the collectives as gloo runs them: its all-reduce, timed and fitted
        bw, hop = fitted
    else:                           # a ring step among busy ranks, from send/recv and a 4-byte all-reduce
        bw, hop = cal["beta"], max(cal["alpha"], cal["allreduce_small_s"] / (2 * (devices - 1)))
    return Cluster(devices, 1, 16e9, cal["flops"], bw, bw, hop, hop,
                   optimizer_seconds_per_param=cal["optimizer_s_per_param"])

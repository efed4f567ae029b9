"""Chapter 12 against this course's own runs, and the cost model calibrated on this machine.

* :func:`compare_with_tour` runs tour rows (their strategies, their recipes) and puts what they measured
  beside :func:`minipar.plan.estimate` for the same layout: bytes each rank sent (the communication log)
  and memory (the measured peak).
* :func:`calibrate` fits the α-β model of the links (send/recv between 2 ranks over gloo, sizes from 1 KiB
  to 4 MiB, least squares of t = α + S/β) and measures, on n ranks at once (they share the cores), a rank's
  forward + backward FLOP/s, the optimizer's seconds per parameter, a 4-byte all-reduce, and gloo's
  all-reduce, all-gather and reduce-scatter at four sizes each (:func:`allreduce_link`, :func:`op_links`).
* :func:`step_times` really trains the step model with DDP, ZeRO-1/2/3, GPipe and 1F1B, TP and TP + SP on
  n ranks (:data:`STEP_RANKS`: one per core, up to 4), calibrating again on the same ranks just before
  each, and predicts each step with :func:`minipar.plan.estimate` two ways: compute counted (FLOPs / the
  calibrated FLOP/s) and compute measured (the same step run with the wire cut,
  :func:`minipar.observe.wirecut.cut_wire`); and on the first calibration (one thread alone × the share of cores a
  rank gets) to show what that missed.

    python -m minipar bench calibrate [--json] [--steps N]
"""
from __future__ import annotations

import os
import re
import statistics
import time

import torch

from minipar.data.zero_memory import Precision
from minipar.observe.launch_trace import stamped_optimizer
from minipar.models import GPTConfig
from minipar.plan import Cluster, Layout, Transformer, activation_bytes_per_layer, estimate
from minipar.tensor.sequence import uncounted_bytes

__all__ = ["TOUR_LAYOUTS", "compare_with_tour", "calibrate", "step_times", "main", "BENCHMARKS"]

F64 = Precision(8, 8, 16)          # float64 Adam: parameter, gradient, two moments
_GPT = Transformer.from_config(GPTConfig(), 16)
_PIPE = Transformer.from_config(GPTConfig(n_layer=8, n_embd=16, n_head=2), 8)
_TP = Transformer.from_config(GPTConfig(n_embd=32, n_head=4, vocab_size=68), 16)
_LONG = Transformer.from_config(GPTConfig(n_layer=3, n_embd=64, block_size=64), 64)

# tour row name: (model, layout, precision, which bytes, how its memory was measured)
#   "peak": model states + the step's peak (what estimate's total is); "step": only what the step created
#   (activations, gradients, buffers); "layer": activation bytes of one layer; "peak, grads freed": the
#   step starts with gradients set to None (chapter 11), so persistent_grads=False; "bytes only": the row's
#   peak is not of this layout (DDP no_sync's is measured on a whole-batch step)
TOUR_LAYOUTS = {
    "DDP": (_GPT, Layout(dp=4, micro_batch=2), "fp32", "dp", "peak"),
    "ZeRO-1 ring": (_GPT, Layout(dp=4, micro_batch=2, zero=1), "fp32", "dp", "peak"),
    "ZeRO-2 ring": (_GPT, Layout(dp=4, micro_batch=2, zero=2), "fp32", "dp", "peak"),
    "ZeRO-3 ring": (_GPT, Layout(dp=4, micro_batch=2, zero=3), "fp32", "dp", "peak"),
    "DDP no_sync": (_GPT, Layout(dp=4, micro_batch=1, micro_batches=2), "fp32", "dp", "bytes only"),
    "ZeRO-1 gloo": (_GPT, Layout(dp=4, micro_batch=2, zero=1), "fp32", "dp", "peak"),
    "ZeRO-3 gloo": (_GPT, Layout(dp=4, micro_batch=2, zero=3), "fp32", "dp", "peak"),
    "pipeline GPipe": (_PIPE, Layout(pp=4, schedule="gpipe", micro_batch=2, micro_batches=8), F64, "pp", "step"),
    "pipeline 1F1B": (_PIPE, Layout(pp=4, micro_batch=2, micro_batches=8), F64, "pp", "step"),
    "pipeline zero bubble ZB-H1": (_PIPE, Layout(pp=4, schedule="zb-h1", micro_batch=2, micro_batches=8), F64,
                                   "pp", "step"),
    "pipeline interleaved 1F1B": (_PIPE, Layout(pp=4, v=2, schedule="interleaved", micro_batch=2, micro_batches=8),
                                  F64, "pp", "step"),
    "tensor parallel": (_TP, Layout(tp=4, micro_batch=4), "fp32", "tp", "layer"),
    "tensor parallel + sequence parallel": (_TP, Layout(tp=4, sp=True, micro_batch=4), "fp32", "tp", "layer"),
    "DDP + recompute none": (_LONG, Layout(dp=4, micro_batch=2), F64, "dp", "peak, grads freed"),
    "DDP + recompute selective": (_LONG, Layout(dp=4, micro_batch=2, recompute="selective"), F64, "dp",
                                  "peak, grads freed"),
    "DDP + recompute full": (_LONG, Layout(dp=4, micro_batch=2, recompute="full"), F64, "dp", "peak, grads freed"),
}
_CPU = Cluster(devices_per_node=4, nodes=1, memory_bytes=16e9, peak_flops=1e10, intra_bw=1e9, inter_bw=1e9)


def predict(name: str) -> dict:
    """The cost model's bytes and memory for the tour row ``name``, in the row's units."""
    model, layout, precision, key, how = TOUR_LAYOUTS[name]
    e = estimate(model, _CPU, layout, precision=precision, dropout=False, eager=True,
                 persistent_grads=how != "peak, grads freed")
    sent = e.bytes_sent[key] / (model.layers if key == "tp" else 1)        # the TP rows count one layer
    if how == "layer":                                                       # one layer's activations
        memory = activation_bytes_per_layer(model, layout.micro_batch, layout.tp, layout.sp, value_bytes=4,
                                            dropout=False) + uncounted_bytes(model.seq_len, layout.micro_batch,
                                                                             layout.tp, layout.sp)
    elif how == "bytes only":
        memory = None
    elif how == "step":
        memory = e.memory["activations"] + e.memory["grads"] + e.memory["buffers"]
    else:
        memory = e.memory["total"]
    return {"bytes": sent, "memory": memory, "estimate": e, "how": how}


def _measured_memory(row, how):
    if how == "bytes only":
        return None
    if how == "layer":
        found = re.search(r"activations per layer (\d+) B", row.note)
        return int(found.group(1)) if found else None
    return row.peak_bytes_per_rank


def compare_with_tour(names=None) -> list:
    """Run the tour rows ``names`` (default: all of :data:`TOUR_LAYOUTS`) and return one dict per row:
    strategy, bytes in the communication log (the algorithm's count: ``bytes_measured``) / observed on the
    sockets (``bytes_observed``) / predicted, memory measured / predicted, and what the memory is."""
    from minipar.course.tour import strategies
    names = list(TOUR_LAYOUTS) if names is None else list(names)
    runs = {name: run for _, name, run in strategies() if name in names}
    missing = set(names) - set(runs)
    if missing:
        raise ValueError(f"no tour row named {sorted(missing)}; tour rows: {[n for _, n, _ in strategies()]}")
    out = []
    for name in names:
        row = runs[name]()
        want = predict(name)
        out.append({"name": name, "strategy": row.strategy, "matches": row.matches, "bytes_measured": row.bytes_sent_per_rank,
                    "bytes_observed": row.bytes_observed_per_rank, "bytes_predicted": want["bytes"], "memory_measured": _measured_memory(row, want["how"]),
                    "memory_predicted": want["memory"], "memory_is": want["how"]})
    return out


# ---------------------------------------------------------------------------------------------------------
# Calibration: α, β of the links between ranks, FLOP/s of one rank
# ---------------------------------------------------------------------------------------------------------

def _pingpong(rank, world_size, sizes, repeats):
    from minipar import comm
    warm = torch.zeros(1024)
    for _ in range(3):                             # the first messages set up the connection
        comm.send(warm, 1) if rank == 0 else comm.recv(warm, 0)
        comm.recv(warm, 1) if rank == 0 else comm.send(warm, 0)
    times = {}
    for n in sizes:
        buf = torch.zeros(n // 4)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if rank == 0:
                comm.send(buf, 1)
                comm.recv(buf, 1)
            else:
                comm.recv(buf, 0)
                comm.send(buf, 0)
            samples.append((time.perf_counter() - t0) / 2)        # one way
        times[n] = samples[1:]                  # the first is a warm-up
    return times


def pingpong(sizes, repeats: int) -> dict:
    """{bytes: [one-way seconds of each blocking send/recv round trip / 2]} between two ranks here, ``repeats``
    round trips per size, the first (a warm-up) left out. Its min is the link undisturbed (chapter 4's α, β);
    its mean what a program pays per message on average (:func:`calibrate`'s ``p2p_alpha``, ``p2p_beta``)."""
    from minipar.launcher import launch
    return launch(_pingpong, 2, list(sizes), repeats, quiet=True)[0]


def _fit(xs, ys):
    """Least squares of y = a + x / b in relative error (weights 1/y², so the small messages that fix α
    count as much as the large ones that fix β, :func:`minipar.observe.fidelity.fit_affine`): returns (a, b)."""
    from minipar.observe.fidelity import fit_affine
    a, slope = fit_affine(xs, ys)
    return a, 1 / slope


def flops_per_second(n: int = 256, repeats: int = 5) -> float:
    """float32 matmul FLOP/s of one thread (ranks run with torch.set_num_threads(1))."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = min(_timed(lambda: a @ b) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def training_flops_per_second(steps: int = 3, ranks: int = 4) -> float:
    """Effective FLOP/s of one thread, alone on the machine, training the step model (model FLOPs of a
    step / its time, best of ``steps``, optimizer included): the old calibration, kept for comparison."""
    from minipar.plan import model_flops
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt, x, y, loss = _local_step_model(ranks)
        step = lambda: (opt.zero_grad(), loss(model, x, y).backward(), opt.step())  # noqa: E731
        step()
        best = min(_timed(step) for _ in range(steps))
    finally:
        torch.set_num_threads(threads)
    return model_flops(STEP_MODEL, STEP_BATCH // ranks) / best


def _local_step_model(ranks: int):
    """(model, optimizer, x, y, loss) of one rank's 1/ranks of a step-model batch, no parallelism."""
    from minipar.check import gpt_recipe
    from minipar.models import TinyGPT
    recipe = gpt_recipe(steps=1, batch_size=STEP_BATCH // ranks, seq_len=STEP_SEQ, **_cfg_kwargs())
    model = TinyGPT(STEP_CONFIG)
    x, y = recipe.batches[0]
    return model, recipe.optimizer(model.parameters()), x, y, recipe.loss


def _contended(rank, world_size, repeats):
    """On every rank at once (the ranks share the cores, as in a real run): the FLOP/s of a forward and
    backward of a 1/n batch, the seconds of one Adam step per parameter, and a 4-byte all-reduce on
    all ranks — each the least disturbed of ``repeats`` (after a warm-up) — and gloo's collectives at
    :data:`ALLREDUCE_SIZES` (:func:`collective_times`: their mean)."""
    import torch.distributed as dist
    from minipar.plan import model_flops
    model, opt, x, y, loss = _local_step_model(world_size)
    n = sum(p.numel() for p in model.parameters())
    fb, adam, small = [], [], []
    tiny = torch.zeros(1)
    for i in range(repeats + 1):
        dist.barrier()
        opt.zero_grad()
        fb.append(_timed(lambda: loss(model, x, y).backward()))
        adam.append(_timed(opt.step))
        dist.barrier()
        small.append(_timed(lambda: dist.all_reduce(tiny)))
    least = lambda v: min(v[1:])  # noqa: E731
    out = {"flops": model_flops(STEP_MODEL, STEP_BATCH // world_size) / least(fb),
           "optimizer_s_per_param": least(adam) / n, "allreduce_small_s": least(small)}
    out.update(collective_times(world_size))
    return out


def collective_times(world_size: int, repeats: int | None = None) -> dict:
    """On every rank at once: {"<op>_<bytes>_s": the mean seconds of ``repeats`` (default
    :data:`COLLECTIVE_REPEATS`) calls of gloo's all-reduce, all-gather and reduce-scatter of
    :data:`ALLREDUCE_SIZES` bytes, each call after a barrier, "<op>_<bytes>_median_s": their median}.

    The mean, not the median: here a call's time has two modes (a few hundred µs, or ~2 ms when a rank's
    blocked threads are woken late: a quarter to a half of the calls), and a step pays the sum of its calls —
    the expected call, not the typical one."""
    import torch.distributed as dist
    repeats = repeats or COLLECTIVE_REPEATS
    out = {}
    for size in ALLREDUCE_SIZES:
        for key, call in _collective_calls(size, world_size).items():
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                times.append(_timed(call))
            out[f"{key}_{size}_s"] = sum(times[1:]) / repeats          # the first: a warm-up
            out[f"{key}_{size}_median_s"] = statistics.median(times[1:])
    return out


def _collective_calls(size: int, n: int) -> dict:
    """{key: a call of gloo's op on ``size`` bytes of payload (minipar.comm's S)}: all-reduce ("allreduce",
    the key it always had), all-gather (S: the gathered whole) and reduce-scatter (S: the full input)."""
    from minipar import comm
    whole = torch.zeros(max(n, size // 4 // n * n))
    part = torch.zeros(whole.numel() // n)
    return {"allreduce": lambda: comm.all_reduce(whole),
            "all_gather": lambda: comm.all_gather_into_tensor(whole, part),
            "reduce_scatter": lambda: comm.reduce_scatter_tensor(part, whole)}


ALLREDUCE_SIZES = (4, 2 ** 16, 2 ** 19, 2 ** 21)       # bytes of the collectives calibrate() times
COLLECTIVE_REPEATS = 60            # calls per op and size: the mean of a two-mode time settles to ~10 %
_TIMED_OPS = ("allreduce_", "all_gather_", "reduce_scatter_")   # their keys: f"{op}_{bytes}_s"


def allreduce_link(cal: dict, devices: int):
    """(β, α) of one ring step fitted to gloo's own all-reduce on ``devices`` ranks, t = 2(n-1)·α +
    2(n-1)/n · S/β (least squares in relative error over :data:`ALLREDUCE_SIZES`); None if not measured."""
    from minipar.observe.fidelity import fit_link
    points = {size: cal[f"allreduce_{size}_s"] for size in ALLREDUCE_SIZES if f"allreduce_{size}_s" in cal}
    try:
        return fit_link("all_reduce", devices, points)
    except ValueError:              # fewer than two sizes, or no growth with size: not measured usefully
        return None


def op_links(cal: dict, devices: int):
    """:class:`minipar.observe.fidelity.OpLinks` of this machine: each collective gloo was timed doing (all-reduce,
    all-gather, reduce-scatter; :data:`ALLREDUCE_SIZES`) on its own fitted α, β (:func:`minipar.observe.fidelity.
    fit_link`), send/recv on the ping-pong's α, β. None where ``cal`` has no per-op timings."""
    from minipar.observe.fidelity import OpLinks, fit_link
    ops = {}
    for op, key in (("all_reduce", "allreduce"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter")):
        samples = {size: cal[f"{key}_{size}_s"] for size in ALLREDUCE_SIZES if f"{key}_{size}_s" in cal}
        if len(samples) >= 2:
            try:
                ops[op] = fit_link(op, devices, samples)
            except ValueError:          # no growth with size (a noisy calibration): the cluster's link
                pass
    p2p = (cal["p2p_beta"], cal["p2p_alpha"]) if "p2p_beta" in cal else (cal["beta"], cal["alpha"])
    return OpLinks(ops, p2p) if ops else None


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
    from minipar.launcher import launch
    samples = pingpong(sizes, max(repeats, COLLECTIVE_REPEATS))
    times = {size: min(v) for size, v in samples.items()}            # min: the least disturbed by others
    alpha, beta = _fit(list(times), list(times.values()))
    p2p_alpha, p2p_beta = _fit(list(samples), [sum(v) / len(v) for v in samples.values()])
    n = ranks or STEP_RANKS
    ranks = launch(_contended, n, repeats, quiet=True)
    mean = lambda k: sum(r[k] for r in ranks) / len(ranks)  # noqa: E731
    return {"alpha": max(alpha, 0.0), "beta": beta, "p2p_alpha": max(p2p_alpha, 0.0), "p2p_beta": p2p_beta,
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


# ---------------------------------------------------------------------------------------------------------
# Step times: the tour's strategies really run on n ranks vs predicted with the calibrated cluster
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


def _cfg_kwargs():
    c = STEP_CONFIG
    return {"n_layer": c.n_layer, "n_embd": c.n_embd, "n_head": c.n_head, "vocab_size": c.vocab_size,
            "block_size": c.block_size}


def _train(rank, world_size, name, recipe):
    """Train ``recipe`` with the library's strategy ``name`` (a key of :func:`step_layouts`)."""
    from minipar.data import ddp, zero
    from minipar.pipeline import runtime
    from minipar.tensor import gpt
    if name == "DDP":
        ddp.parallel_train(rank, world_size, recipe)
    elif name.startswith("ZeRO-"):
        zero.parallel_train(rank, world_size, recipe, stage=int(name[-1]))
    elif name in ("GPipe", "1F1B"):
        runtime.parallel_train(rank, world_size, recipe, schedule=name.lower(), m=STEP_M)
    else:
        gpt.parallel_train(rank, world_size, recipe, sequence_parallel=name == "TP + SP")


_stamped = stamped_optimizer        # the recipe's optimizer, each step() time-stamped and marked "step"


def _timed_train(rank, world_size, name, steps, cut):
    """(seconds of one training step of strategy ``name``, seconds per step spent inside minipar.comm's
    collectives). A step is the time between the ends of two consecutive optimizer steps (set-up and the
    first step's allocations fall before the first stamp), the least disturbed of ``steps - 1``; the time in
    collectives is their logged seconds summed over the run / ``steps`` (waiting for the other ranks
    included; the set-up's broadcasts and the final gathering of parameters too, a few calls spread over the
    steps; an asynchronous call counts from launch to completion; send/recv not counted: a pipeline posts
    its receives early, so their seconds are mostly the bubble). With ``cut``, the same with the wire cut."""
    import contextlib
    import torch.distributed as dist
    from minipar import comm
    from minipar.check import gpt_recipe
    from minipar.observe.wirecut import cut_wire
    recipe = gpt_recipe(steps=steps, batch_size=STEP_BATCH, seq_len=STEP_SEQ, **_cfg_kwargs())
    stamps = []
    recipe.optimizer = _stamped(recipe.optimizer, stamps)
    dist.barrier()
    with comm.recording() as log, cut_wire() if cut else contextlib.nullcontext():
        _train(rank, world_size, name, recipe)
    in_collectives = sum(r.seconds for r in log.records if r.op not in ("send", "recv"))
    return min(b - a for a, b in zip(stamps, stamps[1:])), in_collectives / steps


def _step_seconds(rank, world_size, names, steps, repeats):
    """{name: (seconds per step, the same with the wire cut, the calibration taken just before, seconds
    per step inside minipar.comm's collectives)} on this
    rank. Right before each strategy, :func:`_contended` calibrates compute and the optimizer on the same
    ranks: the machine is shared, and what else runs on it changes from one second to the next."""
    out = {}
    for name in names:
        cal = _contended(rank, world_size, repeats)
        cut, _ = _timed_train(rank, world_size, name, steps, cut=True)
        real, in_comm = _timed_train(rank, world_size, name, steps, cut=False)
        out[name] = (real, cut, cal, in_comm)
    return out


def planner_options(layout) -> dict:
    """:func:`estimate`'s options for the step model as this course trains it: float32, no dropout, DDP's
    25 MiB buckets; this course's ZeRO reduces one unit (a block, or the rest of the model) at a time."""
    from minipar.plan import parameters
    per_unit = 4 * parameters(STEP_MODEL) / (STEP_CONFIG.n_layer + 1) * 1.001
    return dict(precision="fp32", dropout=False, bucket_bytes=per_unit if layout.zero else 25 * 2 ** 20)


def step_times(cal: dict, names=None, steps: int = 5, repeats: int = 3) -> list:
    """Run each strategy of :func:`step_layouts` (default all) on ``cal["ranks"]`` ranks and predict it.
    One dict per strategy: "name", "layout", "measured" (s/step, the slowest rank), "predicted"
    (:func:`estimate` on the cluster calibrated on the same ranks just before the run: α, β from ``cal``;
    compute = FLOPs / FLOP/s), "terms" (its time terms), "cut" (the step with the wire cut, slowest rank),
    "predicted_cut" (the same estimate with compute = "cut": FlexFlow's way), "terms_cut",
    "predicted_alone" (the first calibration: one thread alone × the share of cores), "in_comm" (seconds
    per step inside minipar.comm's collectives in the real run, the busiest rank: waits included)."""
    from minipar.launcher import launch
    n = cal.get("ranks", STEP_RANKS)
    layouts = step_layouts(n)
    names = list(layouts) if names is None else list(names)
    ranks = launch(_step_seconds, n, names, steps, repeats, quiet=True)
    out = []
    for name in names:
        layout = layouts[name]
        local = {k: sum(r[name][2][k] for r in ranks) / len(ranks) for k in ranks[0][name][2]}
        cluster = calibrated_cluster({**cal, **local}, n)
        kw = planner_options(layout)
        e = estimate(STEP_MODEL, cluster, layout, **kw)
        cut = max(r[name][1] for r in ranks)
        c = estimate(STEP_MODEL, cluster, layout, compute_seconds=cut, **kw)
        alone = estimate(STEP_MODEL, calibrated_cluster(cal, n, contended=False), layout, **kw)
        out.append({"name": name, "layout": str(layout), "measured": max(r[name][0] for r in ranks),
                    "predicted": e.step_seconds, "terms": {k: v for k, v in e.time.items() if k != "total"},
                    "cut": cut, "predicted_cut": c.step_seconds,
                    "terms_cut": {k: v for k, v in c.time.items() if k != "total"},
                    "predicted_alone": alone.step_seconds, "calibration": local, "ranks": n,
                    "in_comm": max(r[name][3] for r in ranks)})
    return out


def main(argv=None) -> int:
    import argparse
    import json
    parser = argparse.ArgumentParser(prog="python -m minipar bench calibrate")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--steps", type=int, default=5, help="training steps per strategy (default 5)")
    args = parser.parse_args(argv)
    if args.steps < 2:                             # a step is the gap between two optimizer steps
        parser.error(f"--steps must be at least 2, got {args.steps}")
    cal = calibrate()
    rows = step_times(cal, steps=args.steps)
    if args.json:
        print(json.dumps({"calibration": {**{k: v for k, v in cal.items() if k != "samples"},
                                          "samples": {str(k): v for k, v in cal["samples"].items()}},
                          "steps": rows}, indent=1))
        return 0
    print(f"alpha {cal['alpha'] * 1e6:.1f} us, beta {cal['beta'] / 1e9:.2f} GB/s; a rank's forward+backward "
          f"{cal['flops'] / 1e9:.2f} GFLOP/s while {cal['ranks']} compute (one thread alone, training: "
          f"{cal['alone_flops'] / 1e9:.2f}; bare matmul {cal['matmul_flops'] / 1e9:.1f}); Adam "
          f"{cal['optimizer_s_per_param'] * 1e9:.1f} ns/param; 4-byte all-reduce on {cal['ranks']} ranks "
          f"{cal['allreduce_small_s'] * 1e6:.0f} us")
    bw, hop = allreduce_link(cal, cal["ranks"])
    print(f"gloo's all-reduce on {cal['ranks']} ranks (median): " + ", ".join(
        f"{size} B {cal[f'allreduce_{size}_s'] * 1e3:.2f} ms" for size in ALLREDUCE_SIZES)
        + f"; fitted ring step: alpha {hop * 1e6:.0f} us, beta {bw / 1e9:.2f} GB/s")
    for n, t in cal["samples"].items():
        print(f"  {n:>9} B one way: {t * 1e6:9.1f} us   model {(cal['alpha'] + n / cal['beta']) * 1e6:9.1f} us")
    print(f"{cal['ranks']} ranks; measured / predicted with compute counted (FLOPs), with compute measured "
          f"(the wire cut), and with the first calibration")
    for r in rows:
        terms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["terms_cut"].items() if v)
        terms += f"; measured in collectives {r['in_comm'] * 1e3:.1f}"
        print(f"{r['name']:8} measured {r['measured'] * 1e3:7.1f} ms   counted {r['predicted'] * 1e3:7.1f} ms "
              f"x{r['measured'] / r['predicted']:.2f}   cut {r['predicted_cut'] * 1e3:7.1f} ms "
              f"x{r['measured'] / r['predicted_cut']:.2f} ({terms})   first x{r['measured'] / r['predicted_alone']:.2f}")
    return 0


def _replay_main(argv=None) -> int:
    from .replay_bench import main as replay_main     # it imports this module: load it when asked
    return replay_main(argv)


BENCHMARKS = {"calibrate": main, "replay": _replay_main}

"""Chapter 12 against this course's own runs, and the cost model calibrated on this machine.

* :func:`compare_with_tour` runs tour rows (their strategies, their recipes) and puts what they measured
  beside :func:`minipar.plan.estimate` for the same layout: bytes each rank sent (the communication log)
  and memory (the measured peak).
* :func:`calibrate` fits the α-β model of the links (send/recv between 2 ranks over gloo, sizes from 1 KiB
  to 4 MiB, least squares of t = α + S/β) and the FLOP/s of one thread (float32 matmuls), the way each
  rank runs.
* :func:`step_times` times training steps of DDP, ZeRO and TP on 4 ranks and predicts them with the
  calibrated cluster.

    python -m minipar bench calibrate
"""
from __future__ import annotations

import re
import time

import torch

from minipar.data.zero_memory import Precision
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
    strategy, bytes measured / predicted, memory measured / predicted, and what the memory is."""
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
                    "bytes_predicted": want["bytes"], "memory_measured": _measured_memory(row, want["how"]),
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
        times[n] = min(samples[1:])             # the first is a warm-up; min: the least disturbed by others
    return times


def _fit(xs, ys):
    """Least squares of y = a + x / b in relative error (weights 1/y², so the small messages that fix α
    count as much as the large ones that fix β): returns (a, b)."""
    w = [1 / y ** 2 for y in ys]
    s0, s1, s2 = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * x * x for wi, x in zip(w, xs))
    t0, t1 = sum(wi * y for wi, y in zip(w, ys)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    slope = (s0 * t1 - s1 * t0) / (s0 * s2 - s1 * s1)
    return (t0 - slope * s1) / s0, 1 / slope


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


def training_flops_per_second(steps: int = 3) -> float:
    """Effective FLOP/s of one thread training the step model (model FLOPs of a step / its time, best of
    ``steps``): what the compute term of the cost model needs, optimizer and overheads included."""
    from minipar.check import gpt_recipe
    from minipar.models import TinyGPT
    from minipar.plan import model_flops
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        recipe = gpt_recipe(steps=1, batch_size=STEP_BATCH // 4, seq_len=STEP_SEQ, **_cfg_kwargs())
        model = TinyGPT(STEP_CONFIG)
        opt = recipe.optimizer(model.parameters())
        x, y = recipe.batches[0]

        def step():
            opt.zero_grad()
            recipe.loss(model, x, y).backward()
            opt.step()
        step()
        best = min(_timed(step) for _ in range(steps))
    finally:
        torch.set_num_threads(threads)
    return model_flops(Transformer.from_config(STEP_CONFIG, STEP_SEQ), STEP_BATCH // 4) / best


def calibrate(sizes=(2 ** 10, 2 ** 14, 2 ** 18, 2 ** 20, 2 ** 22), repeats: int = 9) -> dict:
    """{"alpha": s, "beta": bytes/s, "flops": FLOP/s of one thread training, "matmul_flops": of a bare
    matmul, "samples": {bytes: s}}, measured on this machine."""
    from minipar.launcher import launch
    times = launch(_pingpong, 2, list(sizes), repeats, quiet=True)[0]
    alpha, beta = _fit(list(times), list(times.values()))
    return {"alpha": max(alpha, 0.0), "beta": beta, "flops": training_flops_per_second(),
            "matmul_flops": flops_per_second(), "samples": times}


def calibrated_cluster(cal: dict, devices: int = 4) -> Cluster:
    """The machine as a cluster of ``devices`` ranks. Ranks share the cores: with C cores each of N ranks
    gets min(1, C/N) of one, so its FLOP/s are scaled by that."""
    import os
    share = min(1.0, (os.cpu_count() or 1) / devices)
    return Cluster(devices, 1, 16e9, cal["flops"] * share, cal["beta"], cal["beta"], cal["alpha"], cal["alpha"])


# ---------------------------------------------------------------------------------------------------------
# Step times: measured on 4 ranks vs predicted with the calibrated cluster
# ---------------------------------------------------------------------------------------------------------

STEP_CONFIG = GPTConfig(n_layer=2, n_embd=128, n_head=4, vocab_size=256, block_size=64)
STEP_BATCH, STEP_SEQ = 16, 64


def _ddp_steps(rank, world_size, zero_stage, steps):
    """Seconds per step: a run of ``steps`` minus a run of 1 step, over steps - 1 (set-up cancels)."""
    from minipar.check import gpt_recipe
    from minipar.data import ddp, zero
    took = {}
    for n in (1, steps):
        recipe = gpt_recipe(steps=n, batch_size=STEP_BATCH, seq_len=STEP_SEQ, **_cfg_kwargs())
        t0 = time.perf_counter()
        if zero_stage is None:
            ddp.parallel_train(rank, world_size, recipe)
        else:
            zero.parallel_train(rank, world_size, recipe, stage=zero_stage)
        took[n] = time.perf_counter() - t0
    return (took[steps] - took[1]) / (steps - 1)


def _cfg_kwargs():
    c = STEP_CONFIG
    return {"n_layer": c.n_layer, "n_embd": c.n_embd, "n_head": c.n_head, "vocab_size": c.vocab_size,
            "block_size": c.block_size}


def step_times(cal: dict, steps: int = 5) -> list:
    """[(name, measured s/step, predicted s/step)] for DDP and ZeRO-1/3 on 4 ranks (float32 Adam)."""
    from minipar.launcher import launch
    model = Transformer.from_config(STEP_CONFIG, STEP_SEQ)
    cluster = calibrated_cluster(cal)
    out = []
    for name, stage in (("DDP", None), ("ZeRO-1", 1), ("ZeRO-3", 3)):
        measured = max(launch(_ddp_steps, 4, stage, steps, quiet=True))
        layout = Layout(dp=4, micro_batch=STEP_BATCH // 4, zero=stage or 0)
        out.append((name, measured, estimate(model, cluster, layout, precision="fp32").step_seconds))
    return out


def main(argv=None) -> int:
    cal = calibrate()
    print(f"alpha {cal['alpha'] * 1e6:.1f} us, beta {cal['beta'] / 1e9:.2f} GB/s, one thread training "
          f"{cal['flops'] / 1e9:.2f} GFLOP/s (bare matmul {cal['matmul_flops'] / 1e9:.1f})")
    for n, t in cal["samples"].items():
        print(f"  {n:>9} B one way: {t * 1e6:9.1f} us   model {(cal['alpha'] + n / cal['beta']) * 1e6:9.1f} us")
    for name, measured, predicted in step_times(cal):
        print(f"{name:8} step measured {measured * 1e3:7.1f} ms   predicted {predicted * 1e3:7.1f} ms")
    return 0


BENCHMARKS = {"calibrate": main}

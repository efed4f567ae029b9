"""Time each operator of a GPT layer on a GPU and set it beside the device model (minipar.machine.device).

The one script to run where a GPU is at hand (nothing in the course depends on it; under 8 minutes on one
GPU). For three layer sizes it times, with CUDA events (median of ``--repeats`` after a warm-up), each
operator of a layer's forward and backward as PyTorch runs it eagerly — matmuls, the attention core
(scores in HBM, and torch's fused scaled_dot_product_attention), LayerNorm, GeLU, dropout, residual adds —
and one whole layer's forward + backward (a plain pre-norm GPT block written here), and prints and saves,
per operator class, measured / model. The goal the issue sets:
within ±25 % per class. The JSON it writes is labelled with the device's name and the date; commit it under
``minipar/machine/data/gpu/`` (package data: :mod:`minipar.machine.gpu_measured` reads it) for chapter 12 to show.

    python tools/gpu_operators.py --out minipar/machine/data/gpu/<card>_<date>_runN.json   # on a GPU
    python tools/gpu_operators.py --device cpu --tiny --out /tmp/x.json            # a dry run (tests)
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.nn.functional as F

from minipar.machine.device import (
    A100_SXM_80GB,
    CARDS,
    H100_SXM,
    Op,
    op_seconds,
    ops_seconds,
)
from minipar.observe.opcount import OperatorCounter, kernel_count, ops_of

SIZES = {"tiny layer (launch-bound)": (2, 64, 64, 4), "GPT-2 small layer": (8, 1024, 768, 12),
         "1.3B layer": (4, 2048, 2048, 16), "GPT-3 175B layer, t=8 shard": (1, 2048, 12288, 96)}
TINY = {"tiny": (2, 64, 64, 4)}


def card_for(name: str):
    """The device card matching a CUDA device name (A100 or H100), else None (no comparison)."""
    if "H100" in name:
        return H100_SXM
    if "A100" in name:
        return A100_SXM_80GB
    return CARDS.get(name)


def timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, perf_counter on the CPU)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def operators(b, s, h, a, t, device, dtype):
    """[(name, class, callable, Op)] of one layer's forward and backward on one of ``t`` tp ranks."""
    e = torch.finfo(dtype).bits // 8
    T, f, d = b * s, 4 * h // t, h // a
    heads = a // t
    x = torch.randn(T, h, device=device, dtype=dtype)
    rows = []

    def mm(name, m, k, n):
        A, B = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        rows.append((name, "gemm", lambda: A @ B, Op(name, "gemm", 2.0 * m * k * n, e * (m * k + k * n + m * n))))

    for name, k, n in (("qkv", h, 3 * h // t), ("out proj", h // t, h), ("fc1", h, f), ("fc2", f, h)):
        mm(name, T, k, n)
        mm(name + " dX", T, n, k)
        mm(name + " dW", k, T, n)
    q, k_ = (torch.randn(b * heads, s, d, device=device, dtype=dtype) for _ in range(2))
    scores = torch.randn(b * heads, s, s, device=device, dtype=dtype)
    rows.append(("scores QKᵀ", "gemm", lambda: torch.bmm(q, k_.transpose(1, 2)),
                 Op("scores", "gemm", 2.0 * b * heads * s * s * d, e * (2 * b * heads * s * d + b * heads * s * s))))
    rows.append(("softmax", "memory", lambda: torch.softmax(scores, -1), Op("softmax", "memory", 0, 2.0 * e * scores.numel())))
    rows.append(("attention dropout", "memory", lambda: F.dropout(scores, 0.1),
                 Op("dropout", "memory", 0, (2.0 * e + 1) * scores.numel())))
    qs, ks, vs = (torch.randn(b, heads, s, d, device=device, dtype=dtype) for _ in range(3))
    rows.append(("sdpa causal", "attention", lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                 Op("sdpa", "attention", 2.0 * T * s * d * heads, e * 4 * T * d * heads)))
    ln = torch.nn.LayerNorm(h, device=device, dtype=dtype)
    rows.append(("layernorm", "memory", lambda: ln(x), Op("layernorm", "memory", 0, 2.0 * e * x.numel())))
    hidden = torch.randn(T, f, device=device, dtype=dtype)
    rows.append(("gelu", "memory", lambda: F.gelu(hidden), Op("gelu", "memory", 0, 2.0 * e * hidden.numel())))
    rows.append(("residual add", "memory", lambda: x + x, Op("add", "memory", 0, 3.0 * e * x.numel())))
    return rows


def block_step(b, s, h, a, device, dtype):
    """A pre-norm GPT block (attention with torch's SDPA, a 4h GeLU MLP) and its forward + backward step."""
    torch.manual_seed(0)
    block = torch.nn.ModuleDict({"ln1": torch.nn.LayerNorm(h), "qkv": torch.nn.Linear(h, 3 * h),
                                 "proj": torch.nn.Linear(h, h), "ln2": torch.nn.LayerNorm(h),
                                 "fc1": torch.nn.Linear(h, 4 * h), "fc2": torch.nn.Linear(4 * h, h)}).to(device, dtype)
    x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)

    def step():
        q, k, v = block["qkv"](block["ln1"](x)).view(b, s, 3, a, h // a).permute(2, 0, 3, 1, 4)
        y = x + block["proj"](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        y = y + block["fc2"](F.gelu(block["fc1"](block["ln2"](y))))
        y.sum().backward()
    return step


def timed_stream(fn, device, repeats: int, k: int = 10) -> float:
    """Median seconds of ``fn()`` when ``k`` calls run back to back (the launch hidden under the previous
    kernel, as in a training step's stream): the time the model's max(FLOP, byte) term should predict."""
    return timed(lambda: [fn() for _ in range(k)], device, repeats) / k


def profiled(step, runs: int = 5) -> dict:
    """{"profiled_kernels", "profiled_kernel_s"} of one ``step()`` on a GPU: the kernels torch.profiler saw,
    and their own time (the device busy, launch gaps excluded), means over ``runs``."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    return {"profiled_kernels": len(kernels) / runs,
            "profiled_kernel_s": sum(e.time_range.elapsed_us() for e in kernels) / runs / 1e6}


def block_check(b, s, h, a, device, dtype, card, repeats: int) -> dict:
    """One block's forward + backward: measured wall time; its operators counted where it runs
    (:class:`minipar.observe.opcount.OperatorCounter`: on a GPU, SDPA is the flash kernel) and priced on the
    card, as a replay prices a trace; on a GPU, the kernels' own time and number from torch.profiler."""
    step = block_step(b, s, h, a, device, dtype)
    with OperatorCounter() as counter:
        step()
    rows = counter.take()
    rounds = [timed(step, device, repeats) for _ in range(3)]       # three medians: the run-to-run spread
    got = {"measured_s": statistics.median(rounds), "rounds_s": rounds, "counted_kernels": kernel_count(rows),
           "counted_ops": rows, "model_s": ops_seconds(ops_of(rows), card) if card else None}
    if device.type == "cuda":
        got |= profiled(step)
    return got


COURSE_MODELS = {"TinyGPT (the course's default)": {}, "TinyGPT 4L/256h, seq 128": {"n_layer": 4, "n_embd": 256, "n_head": 4,
                                                                                        "block_size": 128}}


def course_step(cfg_changes: dict, device, card, repeats: int, seq_len: int = 16) -> dict:
    """One training step (forward, backward, Adam) of the course's TinyGPT on ``device`` in float32: measured
    wall time, its operators counted where it runs, priced on the card (what chapter 12 does with a trace
    taken on the CPU), and the kernels the profiler saw."""
    from minipar.check import gpt_recipe
    seq = 128 if cfg_changes else seq_len
    recipe = gpt_recipe(steps=1, seq_len=seq, **cfg_changes)
    model = recipe.model().to(device)
    opt = recipe.optimizer(model.parameters())
    x, y = (t.to(device) for t in recipe.batches[0])

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(x, y).backward()
        opt.step()
    step()
    with OperatorCounter() as counter:
        step()
    rows = counter.take()
    rounds = [timed(step, device, repeats) for _ in range(3)]
    got = {"tokens": x.numel(), "measured_s": statistics.median(rounds), "rounds_s": rounds,
           "counted_kernels": kernel_count(rows),
           "counted_ops": rows, "model_s": ops_seconds(ops_of(rows), card) if card else None}
    if device.type == "cuda":
        got |= profiled(step)
    return got


def launch_floor(device, count: int = 2000) -> float:
    """Wall seconds per eager operator when each does almost nothing: ``count`` one-element adds enqueued back
    to back, then one synchronize (the device model's launch floor is this number)."""
    x = torch.zeros(1, device=device)
    for _ in range(50):
        x = x + 1
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(count):
        x = x + 1
    sync()
    return (time.perf_counter() - t0) / count


def adam_step(parameters: int, device, repeats: int):
    """Median seconds of one multi-tensor AdamW step over ``parameters`` FP32 numbers in 12 tensors, and its
    model: a memory-bound op reading weight, gradient, m, v and writing weight, m, v (28 bytes a parameter)."""
    n = parameters // 12
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for _ in range(12)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    return timed(opt.step, device, repeats), Op("adamw", "memory", 0.0, 28.0 * n * 12, 12)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="one tiny size (a dry run on the CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run where a GPU is at hand, or --device cpu --tiny for a dry run")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    card = card_for(name)
    report = {"device": name, "card": card.name if card else None, "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "dtype": str(dtype), "sizes": {}}
    floor = launch_floor(device)
    report["launch_floor_s"] = floor
    print(f"launch floor: {floor * 1e6:.2f} µs per eager operator (model {5.0:.1f} µs)")
    adam_s, adam_op = adam_step(1_000_000 if args.tiny else 200_000_000, device, args.repeats)
    report["adamw"] = {"parameters": adam_op.bytes / 28.0, "measured_s": adam_s,
                       "model_s": op_seconds(adam_op, card) if card else None}
    print(f"AdamW over {adam_op.bytes / 28.0:.3g} FP32 parameters: {adam_s * 1e3:.3f} ms"
          + (f" model {report['adamw']['model_s'] * 1e3:.3f} ms" if card else ""))
    for label, (b, s, h, a) in (TINY if args.tiny else SIZES).items():
        t = 8 if "t=8" in label else 1
        rows, classes = [], {}
        for op_name, kind, fn, op in operators(b, s, h, a, t, device, dtype):
            seconds = timed(fn, device, args.repeats)
            model = op_seconds(op, card) if card else None
            rows.append({"op": op_name, "class": kind, "flops": op.flops, "bytes": op.bytes, "kernels": op.kernels,
                         "measured_s": seconds, "model_s": model,
                         "stream_s": timed_stream(fn, device, max(3, args.repeats // 4))})
            got = classes.setdefault(kind, [0.0, 0.0])
            got[0] += seconds
            got[1] += model or 0.0
        block = block_check(b, s, h // t, a // t, device, dtype, card, args.repeats)
        step = block["measured_s"]
        report["sizes"][label] = {"shape": {"b": b, "s": s, "h": h, "a": a, "t": t}, "operators": rows,
                                  "classes": {k: {"measured_s": m, "model_s": p or None,
                                                  "ratio": m / p if p else None} for k, (m, p) in classes.items()},
                                  "block_step_s": step, "block": block}
        for k, (m, p) in classes.items():
            print(f"{label:30s} {k:10s} measured {m * 1e3:9.3f} ms" + (f"  model {p * 1e3:9.3f} ms  ×{m / p:.2f}" if p else ""))
        print(f"{label:30s} block forward+backward measured {step * 1e3:.3f} ms"
              + (f"  model {block['model_s'] * 1e3:.3f} ms  ×{step / block['model_s']:.2f}" if card else "")
              + f"  {block['counted_kernels']} counted kernels"
              + (f", profiled {block['profiled_kernels']:.0f} kernels {block['profiled_kernel_s'] * 1e3:.3f} ms"
                 if "profiled_kernels" in block else ""))
    report["course"] = {}
    course = dict(list(COURSE_MODELS.items())[:1]) if args.tiny else COURSE_MODELS   # a dry run: the plumbing once
    for label, changes in course.items():
        got = course_step(changes, device, card, args.repeats)
        report["course"][label] = got
        print(f"{label:30s} training step measured {got['measured_s'] * 1e3:.3f} ms"
              + (f"  model {got['model_s'] * 1e3:.3f} ms  ×{got['measured_s'] / got['model_s']:.2f}" if card else "")
              + f"  {got['counted_kernels']} counted kernels"
              + (f", profiled {got['profiled_kernels']:.0f} kernels {got['profiled_kernel_s'] * 1e3:.3f} ms"
                 if "profiled_kernels" in got else ""))
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Time each operator of a GPT layer on a GPU and set it beside the device model (minipar.observe.device).

The one script to run where a GPU is at hand (nothing in the course depends on it; under 8 minutes on one
GPU). For three layer sizes it times, with CUDA events (median of ``--repeats`` after a warm-up), each
operator of a layer's forward and backward as PyTorch runs it eagerly — matmuls, the attention core
(scores in HBM, and torch's fused scaled_dot_product_attention), LayerNorm, GeLU, dropout, residual adds —
and one whole layer's forward + backward (a plain pre-norm GPT block written here), and prints and saves,
per operator class, measured / model. The goal the issue sets:
within ±25 % per class. The JSON it writes is labelled with the device's name and the date; commit it under
``figures/data/`` for chapter 12 to show.

    python tools/gpu_operators.py --out figures/data/gpu_operators.json            # on a GPU
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

from minipar.observe.device import A100_SXM_80GB, CARDS, H100_SXM, Op, op_seconds

SIZES = {"GPT-2 small layer": (8, 1024, 768, 12), "1.3B layer": (4, 2048, 2048, 16),
         "GPT-3 175B layer, t=8 shard": (1, 2048, 12288, 96)}
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
    for label, (b, s, h, a) in (TINY if args.tiny else SIZES).items():
        t = 8 if "t=8" in label else 1
        rows, classes = [], {}
        for op_name, kind, fn, op in operators(b, s, h, a, t, device, dtype):
            seconds = timed(fn, device, args.repeats)
            model = op_seconds(op, card) if card else None
            rows.append({"op": op_name, "class": kind, "measured_s": seconds, "model_s": model})
            got = classes.setdefault(kind, [0.0, 0.0])
            got[0] += seconds
            got[1] += model or 0.0
        step = timed(block_step(b, s, h // t if t > 1 else h, a // t, device, dtype), device, args.repeats)
        report["sizes"][label] = {"shape": {"b": b, "s": s, "h": h, "a": a, "t": t}, "operators": rows,
                                  "classes": {k: {"measured_s": m, "model_s": p or None,
                                                  "ratio": m / p if p else None} for k, (m, p) in classes.items()},
                                  "block_step_s": step}
        for k, (m, p) in classes.items():
            print(f"{label:30s} {k:10s} measured {m * 1e3:9.3f} ms" + (f"  model {p * 1e3:9.3f} ms  ×{m / p:.2f}" if p else ""))
        print(f"{label:30s} block forward+backward measured {step * 1e3:.3f} ms")
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What one H100 measured, beside the device model (:mod:`minipar.machine.device`): the model's check on a GPU.

``tools/gpu_operators.py`` ran three times on one NVIDIA H100 80GB HBM3 (700 W, torch 2.11, bf16 for the
layers, float32 for the course's model; 2026-11-27); its JSON files are package data, in
``minipar/machine/data/gpu/`` (read with ``importlib.resources``, so an installed minipar has them). They hold,
for four layer sizes (a launch-bound tiny one, GPT-2 small, 1.3B, a GPT-3 layer's t = 8 shard):

* each operator timed alone and ten times back to back ("stream": the launch hidden under the previous
  kernel, which is what the roofline term predicts) with CUDA events, beside its model;
* one block's forward + backward: wall time, its operators counted where it ran (SDPA is the flash kernel
  there), and the profiler's kernel count and kernel time;
* (runs 2–3) three medians of each block, and (run 3) a training step of the course's TinyGPT at two sizes.

This module reads them and derives the three numbers the model takes from them: the H100's GEMM
efficiency (:func:`gemm_efficiency`), the host's seconds per eager operator (:func:`host_seconds_per_operator`),
and the check that every measured step lies within its :func:`~minipar.machine.device.eager_bounds`
(:func:`step_rows`). Nothing here runs on a GPU: the numbers are what the runs wrote.
"""
from __future__ import annotations

import json
import statistics
from importlib import resources

from .device import CARDS, EAGER_HOST_SECONDS, H100_SXM, DeviceCard, Op, eager_bounds, op_seconds, ops_of
from .gemm import shape_efficiency

__all__ = ["RUNS_DIR", "runs", "gemm_shapes", "gemm_efficiency", "full_tile_efficiency", "gemm_rows", "class_ratios",
           "host_seconds_per_operator", "step_rows", "table_text"]

RUNS_DIR = resources.files("minipar.machine") / "data" / "gpu"     # package data (pyproject.toml), not a repo path
LAUNCH_BOUND = ("tiny layer (launch-bound)", "TinyGPT (the course's default)", "TinyGPT 4L/256h, seq 128")


def runs(folder=RUNS_DIR) -> list:
    """The runs' reports, oldest first, each with ``"file"`` added (``folder``: a path or a package resource)."""
    files = sorted((p for p in folder.iterdir() if p.name.endswith(".json")), key=lambda p: p.name)
    return [json.loads(p.read_text(encoding="utf-8")) | {"file": p.name} for p in files]


def _op(row: dict) -> Op:
    return Op(row["op"], row["class"], row["flops"], row["bytes"], row["kernels"])


def gemm_shapes(shape: dict) -> dict:
    """{operator: (batch, M, K, N)} of the matmuls tools/gpu_operators.py timed for a layer of ``shape``
    ({"b", "s", "h", "a", "t"}): each weight matmul [T, k] × [k, n], its dX [T, n] × [n, k] and dW
    [k, T] × [T, n] (T = b·s), and the scores QKᵀ, b·a/t batched [s, d] × [d, s]."""
    b, s, h, a, t = (shape[k] for k in "bshat")
    T, f = b * s, 4 * h // t
    out = {}
    for name, k, n in (("qkv", h, 3 * h // t), ("out proj", h // t, h), ("fc1", h, f), ("fc2", f, h)):
        out |= {name: (1, T, k, n), name + " dX": (1, T, n, k), name + " dW": (1, k, T, n)}
    return out | {"scores QKᵀ": (b * a // t, s, h // a, s)}


def _gemms(reports: list):
    """(report, size label, row, (batch, M, K, N)) of every matmul timed back to back, launch-bound sizes out."""
    for report in reports:
        for label, size in report["sizes"].items():
            shapes = gemm_shapes(size["shape"])
            for row in size["operators"]:
                if label not in LAUNCH_BOUND and row["class"] == "gemm" and "stream_s" in row:
                    yield report, label, row, shapes[row["op"]]


def gemm_efficiency(reports: list, card: DeviceCard = H100_SXM) -> tuple:
    """(median, low, high) fraction of the card's peak the matmuls reached, timed back to back (their launch
    hidden: the card's launch floor taken off), the launch-bound tiny layer left out: their tiles' and their
    bytes' losses included (:func:`full_tile_efficiency` takes them out)."""
    etas = [row["flops"] / ((row["stream_s"] - card.launch_floor) * card.peak_flops) for _, _, row, _ in _gemms(reports)]
    return statistics.median(etas), min(etas), max(etas)


def full_tile_efficiency(reports: list, card: DeviceCard = H100_SXM) -> tuple:
    """(median, low, high) of what a full tile sustained: each matmul's fraction of the peak
    (:func:`gemm_efficiency`) ÷ its shape's efficiency on the card (:func:`minipar.machine.gemm.shape_efficiency`),
    over the matmuls the roofline says are bound by their FLOPs (bytes ÷ HBM under half their time); the
    median is what the card's ``gemm_efficiency`` says."""
    etas = []
    for _, _, row, shape in _gemms(reports):
        seconds = row["stream_s"] - card.launch_floor
        if row["bytes"] / (card.hbm_bandwidth * card.memory_efficiency) < 0.5 * seconds:
            etas.append(row["flops"] / (seconds * card.peak_flops * shape_efficiency(shape, card.sms,
                                                                                      card.gemm_scheduler)))
    return statistics.median(etas), min(etas), max(etas)


def gemm_rows(reports: list, card: DeviceCard = H100_SXM) -> list:
    """Every matmul timed back to back beside the model, with and without its shape: {"size", "op", "shape",
    "measured", "model" (with the shape), "flat" (the card's η for every shape), "error", "flat_error"
    (model ÷ measured − 1)}."""
    rows = []
    for _, label, row, shape in _gemms(reports):
        with_shape = op_seconds(Op(row["op"], "gemm", row["flops"], row["bytes"], 1, 1, shape), card)
        flat = op_seconds(Op(row["op"], "gemm", row["flops"], row["bytes"], 1), card)
        rows.append({"size": label, "op": row["op"], "shape": shape, "measured": row["stream_s"],
                     "model": with_shape, "flat": flat, "error": with_shape / row["stream_s"] - 1,
                     "flat_error": flat / row["stream_s"] - 1})
    return rows


def class_ratios(report: dict, card: DeviceCard | None = None) -> dict:
    """{size: {class: measured ÷ model}} for one run (the operators timed back to back where the run did,
    else alone), the model on ``card`` (default: the run's card as it is now)."""
    card = card or CARDS[report["card"]]
    out = {}
    for label, size in report["sizes"].items():
        sums = {}
        for row in size["operators"]:
            got = sums.setdefault(row["class"], [0.0, 0.0])
            got[0] += row.get("stream_s", row["measured_s"])
            got[1] += op_seconds(_op(row), card)
        out[label] = {k: m / p for k, (m, p) in sums.items()}
    return out


def _steps(report: dict):
    """(label, measured seconds, rounds, counted operator rows) of each block and course step of a run."""
    for label, size in report["sizes"].items():
        block = size.get("block", {})
        if "counted_ops" in block:
            yield label, block["measured_s"], block.get("rounds_s", [block["measured_s"]]), block["counted_ops"]
    for label, step in report.get("course", {}).items():
        yield label, step["measured_s"], step["rounds_s"], step["counted_ops"]


def host_seconds_per_operator(reports: list) -> tuple:
    """(median, every value): a launch-bound step's wall seconds ÷ its counted kernels, per run and round."""
    values = [seconds / sum(r["count"] * r.get("kernels", 1) for r in rows)
              for report in reports for label, _, rounds, rows in _steps(report) if label in LAUNCH_BOUND
              for seconds in rounds]
    return statistics.median(values), values


def step_rows(reports: list, host: float = EAGER_HOST_SECONDS) -> list:
    """Every measured block and course step beside the model: {"run", "step", "measured" (median), "spread"
    (min, max of its rounds), "kernels", "device" (the card's price of its counted operators: roofline +
    launch floor), "low", "high" (:func:`eager_bounds`), "ratio" (measured ÷ the bound it passed, 1 inside)}."""
    rows = []
    for report in reports:
        card = CARDS[report["card"]]
        for label, measured, rounds, counted in _steps(report):
            ops = ops_of(counted)
            low, high = eager_bounds(ops, card, host)
            ratio = measured / low if measured < low else measured / high if measured > high else 1.0
            rows.append({"run": report["file"], "step": label, "measured": measured,
                         "spread": (min(rounds), max(rounds)), "kernels": sum(o.count * o.kernels for o in ops),
                         "device": sum(op_seconds(o, card) for o in ops), "low": low, "high": high,
                         "ratio": ratio})
    return rows


def table_text(rows: list) -> str:
    """The rows of :func:`step_rows` as a fixed-width table, milliseconds."""
    lines = [f"{'run':28s} {'step':31s} {'measured (spread)':>22s} {'kernels':>7s} {'device':>7s} "
             f"{'bounds':>15s}  ratio"]
    for r in rows:
        lo, hi = r["spread"]
        lines.append(f"{r['run']:28s} {r['step']:31s} {r['measured'] * 1e3:7.3f} ({lo * 1e3:5.2f}–{hi * 1e3:5.2f}) "
                     f"{r['kernels']:7.0f} {r['device'] * 1e3:7.3f} {r['low'] * 1e3:6.3f}–{r['high'] * 1e3:6.3f}"
                     f"  {r['ratio']:.2f}")
    return "\n".join(lines)

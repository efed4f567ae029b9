"""``python -m minipar bench gpu [--json]``: the device model against what one H100 measured.

Reads the runs of ``tools/gpu_operators.py`` committed in ``minipar/machine/data/gpu/`` (:mod:`minipar.machine.gpu_measured`;
no GPU is needed to read them) and prints: the matmul efficiency they give beside the H100 card's, the host
seconds per eager operator beside :data:`~minipar.machine.device.EAGER_HOST_SECONDS`, measured ÷ model per
operator class and layer size, and every measured block and training step beside its eager bounds. Exits 1 if
a step of the newest run lies more than 15 % outside its bounds.
"""
from __future__ import annotations

import argparse
import json

from minipar.machine import gpu_measured
from minipar.machine.device import EAGER_HOST_SECONDS, H100_SXM

__all__ = ["TOLERANCE", "main"]

TOLERANCE = 0.15


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar bench gpu", allow_abbrev=False)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    reports = gpu_measured.runs()
    eta, low, high = gpu_measured.gemm_efficiency(reports)
    host, values = gpu_measured.host_seconds_per_operator(reports)
    rows = gpu_measured.step_rows(reports)
    newest = reports[-1]["file"]
    outside = [r for r in rows if r["run"] == newest and abs(r["ratio"] - 1) > TOLERANCE]
    if args.json:
        print(json.dumps({"gemm_efficiency": [eta, low, high], "card_gemm_efficiency": H100_SXM.gemm_efficiency,
                          "host_seconds": values, "card_host_seconds": EAGER_HOST_SECONDS,
                          "classes": {r["file"]: gpu_measured.class_ratios(r) for r in reports}, "steps": rows},
                         indent=1))
        return 1 if outside else 0
    print(f"runs: {', '.join(r['file'] for r in reports)} ({reports[-1]['device']}, torch {reports[-1]['torch']})")
    print(f"matmul efficiency, measured: median {eta:.3f} (range {low:.2f}–{high:.2f}); the H100 card says "
          f"{H100_SXM.gemm_efficiency}")
    print(f"host seconds per eager operator, measured: median {host * 1e6:.1f} µs (range "
          f"{min(values) * 1e6:.0f}–{max(values) * 1e6:.0f} µs, {len(values)} launch-bound timings); the model "
          f"says {EAGER_HOST_SECONDS * 1e6:.0f} µs")
    print("measured ÷ model per operator class (timed back to back where the run did):")
    for report in reports:
        for size, classes in gpu_measured.class_ratios(report).items():
            print(f"  {report['file']:28s} {size:30s} " + "  ".join(f"{k} {v:.2f}" for k, v in classes.items()))
    print("blocks and training steps, milliseconds: measured beside the eager bounds (a model)")
    print(gpu_measured.table_text(rows))
    print(f"{len(rows) - sum(abs(r['ratio'] - 1) > TOLERANCE for r in rows)} of {len(rows)} within ±{TOLERANCE:.0%} "
          f"of their bounds; newest run: {len(outside)} outside")
    return 1 if outside else 0

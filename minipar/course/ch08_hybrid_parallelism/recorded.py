"""Chapter 08's PyTorch-side runs, written down once: §6 shows a recorded measurement.

Training the chapter's recipe with PyTorch's own pieces (DeviceMesh, DTensor, FSDP2's ``replicate``,
``torch.distributed.pipelining``, ``loss_parallel``) on 8 CPU ranks costs each rank seconds of DTensor
sharding propagation, tens of seconds on two shared cores; the chapter must run in seconds. So ``python -m
minipar bench torch-side`` (:func:`main`) runs what §6 shows — :func:`.torch_side.side_by_side` at 2×2×2
(1F1B, m = 4, 3 Adam steps, float64), :func:`.torch_side.ddp_over_tp_with_mesh` at 2 × 2 and
:func:`.torch_side.ddp_over_tp_error` on 4 ranks — and writes the results to :data:`RECORD` with when, where
and how they were made (:func:`provenance`). :func:`report` reads it back as the chapter's table, labelled as
recorded. The same runs are repeated live by ``test_torch_side.py`` in this folder.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import time

import torch

from minipar.course import ROOT
from minipar.course.report import Report

__all__ = ["RECORD", "COMMAND", "provenance", "record", "load", "report", "main"]

RECORD = ROOT / "figures" / "data" / "08_torch_side.json"
COMMAND = "python -m minipar bench torch-side"
PAIRS = ("minipar_vs_one_device", "torch_vs_one_device", "minipar_vs_torch")


def provenance(started: float, load_before: float) -> dict:
    """UTC start and end, the command, cores, Python and torch versions, the 1-minute load before and after."""
    stamp = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")  # noqa: E731
    return {"started": stamp(started), "finished": stamp(time.time()), "command": COMMAND, "cores": os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
            "load_before": round(load_before, 1), "load_after": round(os.getloadavg()[0], 1)}


def record() -> dict:
    """Run the three PyTorch-side checks of §6 and return them as one JSON-ready dict (with provenance)."""
    from minipar.launcher import launch
    from . import torch_side
    from .measure import recipe
    started, load_before = time.time(), os.getloadavg()[0]
    side = torch_side.side_by_side(recipe(3), dp=2, pp=2, tp=2, micro_batches=4, schedule="1f1b")
    ddp = torch_side.ddp_over_tp_with_mesh(recipe(3), dp=2, tp=2)
    refused = launch(torch_side.ddp_over_tp_error, 4, recipe(1), quiet=True)
    as_dict = lambda c: {"matches": bool(c.matches), "max_abs_diff": float(c.max_abs_diff), "text": str(c)}  # noqa: E731
    return {"recorded": provenance(started, load_before),
            "side_by_side": {"layout": "dp 2 × pp 2 × tp 2, 1F1B, m = 4, 3 Adam steps, float64",
                             **{k: as_dict(side[k]) for k in PAIRS}, "losses": side["losses"]},
            "ddp_device_mesh": {"layout": "dp 2 × tp 2", **as_dict(ddp["vs_one_device"])},
            "ddp_process_group_errors": refused}


def load(path=RECORD) -> dict:
    return json.loads(path.read_text())


def _check(r: Report) -> None:
    rec = r.record
    assert all(rec["side_by_side"][k]["matches"] and rec["side_by_side"][k]["max_abs_diff"] < 1e-10 for k in PAIRS)
    assert rec["ddp_device_mesh"]["matches"] and rec["ddp_device_mesh"]["max_abs_diff"] < 1e-10
    assert all(e and "mixed torch.Tensor and DTensor" in e for e in rec["ddp_process_group_errors"])


def report(path=RECORD) -> Report:
    """§6's table: the recorded PyTorch-side runs, with when, where and by what command they were recorded."""
    rec = load(path)
    meta, side = rec["recorded"], rec["side_by_side"]
    lines = [f"Recorded on {meta['started']} with `{meta['command']}` (not re-run now), {meta['cores']} CPU cores "
             f"({meta['machine']}, load {meta['load_before']}), torch {meta['torch']}, gloo",
             f"{side['layout']}:"]
    lines += [f"  {k:>22}: max |Δ| over losses and parameters = {side[k]['max_abs_diff']:.1e}" for k in PAIRS]
    lines += [f"  {who:>22}: losses {[round(v, 12) for v in losses]}" for who, losses in side["losses"].items()]
    lines.append(f"DDP(model, device_mesh=mesh['dp']) over TP, {rec['ddp_device_mesh']['layout']}: "
                 f"{rec['ddp_device_mesh']['text']}")
    lines.append(f"DDP(model, process_group=...) over TP: {rec['ddp_process_group_errors'][0][:90]} …")
    return Report("\n".join(lines), _check, record=rec)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RECORD), help="where to write the record (JSON)")
    a = parser.parse_args(argv)
    rec = record()
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(report(type(RECORD)(a.out)))
    return 0


"""Appendix A's runs on this machine, written down once: §2–4 show a recorded measurement.

Training eight strategies five rounds over (and each once more with the wire cut, and once with its operators
counted) takes minutes on two cores; the chapter must run in seconds. So ``python -m minipar bench steps
--out figures/data/A_step_times.json`` (:func:`.bench.steps_main`) makes every run those sections show —
the two tensor-parallel tour rows (bytes and one layer's activations), the calibration
(:func:`.calibration.calibrate`), the measured and replayed steps (:func:`.replay_bench.fidelity_table`), the
step times predicted beside them (:func:`.bench.step_times`) and DDP's step traced with its operators counted
and replayed on the A100 card (:func:`.time_model.traced_on_a100`) — and writes them as one JSON file with
when, where and how they were made (:func:`provenance`). :func:`load` reads it back as the functions returned
it; the chapter says where each number comes from (:func:`provenance_text`).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch

from minipar.course import ROOT
from minipar.machine.device import CARDS

__all__ = ["RECORD", "provenance", "as_record", "write", "load", "provenance_text"]

RECORD = ROOT / "figures" / "data" / "A_step_times.json"


def provenance(command: str, started: float, load_before: tuple) -> dict:
    """When, where and how a measurement was made: UTC start and end, the command, this machine's cores,
    CPU model, Python and torch versions, and the load average (1 min) before and after (other processes
    share the cores: their share is in every number)."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    stamp = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")  # noqa: E731
    return {"started": stamp(started), "finished": stamp(datetime.datetime.now().timestamp()), "command": command,
            "cores": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "load_before": round(load_before[0], 1), "load_after": round(os.getloadavg()[0], 1)}


def as_record(tour: list, cal: dict, fid: dict, step_rows: list, a100: dict, meta: dict) -> dict:
    """The results as one JSON-ready dict (the A100 replay without its trace and with its card by name)."""
    a100 = {k: (v.name if k == "card" else v) for k, v in a100.items() if k != "trace"}
    cal = {**cal, "samples": {str(k): v for k, v in cal["samples"].items()}}
    return {"recorded": meta, "tour": tour, "calibration": cal, "fidelity": fid, "step_rows": step_rows,
            "a100_ddp": a100}


def write(record: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load(path=RECORD) -> dict:
    """A record as :func:`as_record` wrote it, the calibration's samples keyed by bytes again and the A100
    replay's card the :data:`minipar.machine.device.CARDS` entry."""
    record = json.loads(Path(path).read_text())
    cal = record["calibration"]
    cal["samples"] = {int(k): v for k, v in cal["samples"].items()}
    record["a100_ddp"]["card"] = CARDS[record["a100_ddp"]["card"]]
    return record


def provenance_text(record: dict) -> str:
    """One line: the record's when, where and how."""
    m = record["recorded"]
    parts = "; ".join(f"{k} {v}" for k, v in m.get("load_by_part", {}).items())
    return (f"recorded {m['started']}–{m['finished'][11:]} on this course's {m['cores']}-core machine ({m['cpu']}; "
            f"torch {m['torch']}), shared with other jobs (load average {m['load_before']} before, "
            f"{m['load_after']} after" + (f"; as each part began: {parts}" if parts else "") + f"), by `{m['command']}`")

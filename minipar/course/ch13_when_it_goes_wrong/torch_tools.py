"""PyTorch's own tools on the chapter's planted shape mismatch, in a fresh process (they are switched on by
environment variables read when the process group is created, so they cannot be turned on in a notebook's
running ranks):

* ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps every process group in a ``ProcessGroupWrapper`` that all-gathers
  a fingerprint of each collective first and raises "Detected mismatch between collectives on ranks";
* the Flight Recorder (``TORCH_FR_BUFFER_SIZE=N``): the last N collectives of the process, read here with
  ``torch._C._distributed_c10d._dump_fr_trace_json``.

    python -m minipar.course.ch13_when_it_goes_wrong.torch_tools FOLDER    # writes FOLDER/report<rank>.json
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

__all__ = ["start", "collect", "run", "detail_message", "main"]


def _rank(rank, folder):
    import datetime

    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=3))
    dist.all_reduce(torch.ones(3))
    report = {"rank": rank}
    try:
        dist.all_reduce(torch.ones(4 if rank == 0 else 8))      # the planted mismatch
    except RuntimeError as exc:
        report["error"] = str(exc)
    dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, True))
    report["recorded"] = [(e["profiling_name"], e["input_sizes"], e["state"]) for e in dump.get("entries", [])]
    with open(os.path.join(folder, f"report{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def main(folder: str) -> None:
    """Two ranks, the planted mismatch; each writes ``folder/report<rank>.json``. (``torchfrtrace``, the
    recorder's analyser, is not run: it is built for NCCL, and on gloo every entry stays "scheduled".)"""
    import torch.multiprocessing as mp
    mp.start_processes(_rank, args=(folder,), nprocs=2, start_method="fork")


def start() -> subprocess.Popen:
    """Start :func:`main` with DETAIL and the Flight Recorder on, in the background (it mostly waits)."""
    env = dict(os.environ, TORCH_DISTRIBUTED_DEBUG="DETAIL", TORCH_FR_BUFFER_SIZE="64")
    folder = tempfile.mkdtemp(prefix="minipar-torch-tools-")
    process = subprocess.Popen([sys.executable, "-m", __name__, folder], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.folder = folder
    return process


def collect(process: subprocess.Popen, timeout: float = 60) -> list:
    """Each rank's report (rank, error, recorded: the Flight Recorder's entries) of a :func:`start`."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    reports = []
    for rank in range(2):
        path = os.path.join(process.folder, f"report{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports.append(json.load(f))
    shutil.rmtree(process.folder, ignore_errors=True)
    if not reports:
        raise RuntimeError(f"PyTorch's tools printed no report:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    return sorted(reports, key=lambda r: r["rank"])


def run(timeout: float = 60) -> list:
    return collect(start(), timeout)


def detail_message(report: dict) -> str:
    """DETAIL's error, with each ``CollectiveFingerPrint`` cut to its sequence number, op, shape and dtype."""
    import re
    text = report.get("error", "").splitlines()[0] if report.get("error") else "no error"
    return re.sub(r", TensorDeviceTypes=TensorOptions\(.*?\(nullopt\)\)\)", ")", text)


if __name__ == "__main__":
    main(sys.argv[1])

"""Start :mod:`torchrun_job` under torchrun from a notebook cell, and collect what every worker wrote.

``python -m torch.distributed.run`` is torchrun (the same entry point, run by this kernel's Python, so the
same environment). ``--standalone`` runs the rendezvous on this machine on a free port; ``OMP_NUM_THREADS=1``
keeps the workers from each starting a thread per core. A worker that fails, or a run that takes longer than
``timeout`` seconds, raises a RuntimeError with the end of torchrun's output; on a timeout the whole process
group this function started (torchrun and its workers) is killed, so no worker is left behind.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from . import torchrun_job

__all__ = ["JOB", "torchrun_command", "run_torchrun_job"]

JOB = Path(torchrun_job.__file__)
# What torchrun sets in a worker: a kernel that carries any of them must not pass them on to torchrun itself.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def torchrun_command(nproc_per_node: int, out_dir: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
            str(JOB), out_dir]


def run_torchrun_job(nproc_per_node: int = 4, timeout: float = 180) -> tuple:
    """Run the job on ``nproc_per_node`` workers; returns (the command as typed in a terminal, one dict per
    rank in rank order: ``rank``, ``world_size``, ``result``, ``env``)."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="minipar-torchrun-") as out_dir:
        cmd = torchrun_command(nproc_per_node, out_dir)
        shown = f"torchrun --standalone --nproc_per_node={nproc_per_node} {JOB.name} OUT_DIR"
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)   # its own process group: killed as one on a timeout
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise RuntimeError(f"torchrun did not finish in {timeout:g} s (killed it and its workers). "
                               f"Command: {shlex.join(cmd)}\n--- its output, last lines ---\n{output[-3000:]}")
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun failed with exit code {proc.returncode}. Command: {shlex.join(cmd)}\n"
                               f"--- its output, last lines ---\n{output[-3000:]}")
        files = sorted(Path(out_dir).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        if len(files) != nproc_per_node:
            raise RuntimeError(f"torchrun exited 0 but {len(files)} of {nproc_per_node} workers wrote a result\n"
                               f"{output[-3000:]}")
        return shown, [json.loads(p.read_text()) for p in files]

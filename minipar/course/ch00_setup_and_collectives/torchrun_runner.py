"""Start :mod:`torchrun_job` under torchrun from a notebook cell, and collect what every worker wrote.

``torchrun`` is ``torch.distributed.run``'s ``main`` (the console script and ``python -m torch.distributed.run``
both call it). Here it runs in a process forked from this kernel, which has imported torch already: a fresh
``python -m torch.distributed.run`` would spend seconds of CPU importing torch before starting anything. The
workers are torchrun's own: it starts each with this kernel's Python (``sys.executable``), as a terminal's
torchrun does. ``--standalone`` runs the rendezvous on this machine on a free port; ``OMP_NUM_THREADS=1``
keeps the workers from each starting a thread per core. A worker that fails, or a run that takes longer than
``timeout`` seconds, raises a RuntimeError with the end of torchrun's output; on a timeout the whole process
group this function started (torchrun and its workers) is killed, so no worker is left behind.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import tempfile
import time
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


def _torchrun(args: list, env: dict, log: str) -> None:
    """In the forked child: a session of its own (killed as one group on a timeout), its output to ``log``,
    ``env`` as its environment, then torchrun's ``main``; never returns (``os._exit``: the kernel's exit
    handlers are not this process's)."""
    code = 1
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)   # not the kernel's streams
        import logging
        for handler in list(logging.root.handlers):
            logging.root.removeHandler(handler)
        os.environ.clear()
        os.environ.update(env)
        from torch.distributed.run import main
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported through the log and the exit code
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
        finally:
            os._exit(code)


def run_torchrun_job(nproc_per_node: int = 4, timeout: float = 180) -> tuple:
    """Run the job on ``nproc_per_node`` workers; returns (the command as typed in a terminal, one dict per
    rank in rank order: ``rank``, ``world_size``, ``result``, ``env``)."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="minipar-torchrun-") as out_dir:
        cmd = torchrun_command(nproc_per_node, out_dir)
        shown = f"torchrun --standalone --nproc_per_node={nproc_per_node} {JOB.name} OUT_DIR"
        log = os.path.join(out_dir, "torchrun.log")
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _torchrun(cmd[3:], env, log)           # the arguments after "python -m torch.distributed.run"
        deadline, status = time.monotonic() + timeout, None
        while status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(raw)
            elif time.monotonic() > deadline:
                for kill in (os.killpg, os.kill):  # its group (torchrun and its workers), and it, whatever happens
                    try:
                        kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os.waitpid(pid, 0)
                raise RuntimeError(f"torchrun did not finish in {timeout:g} s (killed it and its workers). "
                                   f"Command: {shlex.join(cmd)}\n--- its output, last lines ---\n{_tail(log)}")
            else:
                time.sleep(0.02)
        if status != 0:
            raise RuntimeError(f"torchrun failed with exit code {status}. Command: {shlex.join(cmd)}\n"
                               f"--- its output, last lines ---\n{_tail(log)}")
        files = sorted(Path(out_dir).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        if len(files) != nproc_per_node:
            raise RuntimeError(f"torchrun exited 0 but {len(files)} of {nproc_per_node} workers wrote a result\n"
                               f"{_tail(log)}")
        return shown, [json.loads(p.read_text()) for p in files]


def _tail(log: str) -> str:
    try:
        return Path(log).read_text(errors="replace")[-3000:]
    except OSError:
        return ""

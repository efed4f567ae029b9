"""What must hold before a 3D run trains: the checkpoint it resumes is of the same run, the folder it saves into
can be written, holds no other run's checkpoint, is the same folder on every rank that writes, and belongs to
this run alone while it writes (:func:`lock_folder`: a lock file naming the holder's pid, its start time and
host; two runs writing one folder would replace each other's checkpoints); and what a failed write says
(:func:`write_failed`: a full disk names the file and the checkpoint ``latest`` still names).

A run is its model config, seed, dtype and data stream (:func:`run_identity`); a checkpoint's manifest records
them (:mod:`minipar.hybrid.checkpoint`), so :func:`differences` can list what a resume would silently change —
four layers loaded into two, another seed — and the command refuses it before any process starts.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time

import torch
import torch.distributed as dist

from .. import comm
__all__ = ["CheckpointError", "LOCK", "barrier", "run_identity", "differences", "check_folder", "check_shared",
           "process_start", "lock_folder", "unlock_folder", "write_failed"]

LOCK = ".minipar-lock"          # in the --save folder while a run writes: {"pid", "started", "host", "since"}
UNREADABLE_LOCK_SECONDS = 2.0   # a lock still empty or garbage this long after it was written is nobody's
FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# torch.save's zip writer reports a short write (a full disk, a file-size limit) as "unexpected pos N vs M"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong with it."""


def barrier(device) -> None:
    """Every rank of the world waits here, through the logged wrapper (its bytes count like any call's)."""
    comm.all_reduce(torch.zeros(1, device=device))


def run_identity(cfg, *, seed, dtype, data: dict, moe=None) -> dict:
    """What a checkpoint must share with the run that resumes it: the model ``config`` (an MoE model's experts,
    top-k and capacity factor among it: ``moe``, a :class:`~minipar.moe.layer.MoEConfig` or None), the
    ``seed``, the ``dtype`` and the ``data`` stream (source, batch size, sequence length: batch k is the k-th
    step's)."""
    config = dict(vars(cfg))
    if moe is not None:
        config |= {"moe_experts": moe.experts, "moe_top_k": moe.k, "moe_capacity_factor": float(moe.capacity_factor)}
        config |= {f"moe_{name}": getattr(moe, name) for name, default in (("dropless", False), ("shared", 0),
                   ("granularity", 1)) if getattr(moe, name, default) != default}   # only when set: older identities hold
        if getattr(moe, "bias_rate", 0):
            raise ValueError("loss-free balancing's routing biases are not saved in a checkpoint yet: a resumed run "
                             "would restart them at 0")
    return {"config": config, "seed": seed, "dtype": str(dtype).removeprefix("torch."), "data": dict(data)}


def differences(manifest: dict, identity: dict) -> list:
    """["config.n_layer: checkpoint 4, this run 2", ...]: every field of :func:`run_identity` that differs
    (the data position, the step, may)."""
    missing, found = "(not recorded)", []
    for key in ("config", "seed", "dtype", "data"):
        saved, now = manifest.get(key, missing), identity[key]
        if isinstance(now, dict):
            saved = saved if isinstance(saved, dict) else {}
            for k in sorted((set(saved) | set(now)) - {"position"}):
                if saved.get(k, missing) != now.get(k, missing):
                    found.append(f"{key}.{k}: checkpoint {saved.get(k, missing)!r}, this run {now.get(k, missing)!r}")
        elif saved != now:
            found.append(f"{key}: checkpoint {saved!r}, this run {now!r}")
    return found


def check_folder(directory: str) -> None:
    """Create ``directory`` and write and remove a file in it, or :class:`CheckpointError` saying why (a
    file in the way, no permission, a read-only or virtual filesystem): before training, not after."""
    probe = os.path.join(directory, f".minipar-write-test-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"minipar")
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"cannot save into {directory}: {exc.strerror or exc}") from None


def check_shared(directory: str, device="cpu") -> None:
    """A collective: rank 0 writes a token into ``directory``; every rank that writes a shard must read it
    back, or every rank raises :class:`CheckpointError` before training (several nodes without a shared
    filesystem would each save a part of the checkpoint)."""
    token = torch.randint(1, 2**62, (1,), dtype=torch.int64, device=device) if dist.get_rank() == 0 else \
        torch.zeros(1, dtype=torch.int64, device=device)
    comm.all_reduce(token)                                    # everybody learns rank 0's token
    path = os.path.join(directory, ".minipar-shared-test")
    if dist.get_rank() == 0:
        check_folder(directory)
        with open(path, "w") as f:
            f.write(str(int(token)))
    barrier(device)
    try:
        with open(path) as f:
            blind = torch.tensor([f.read() != str(int(token))], dtype=torch.int64, device=device)
    except OSError:
        blind = torch.ones(1, dtype=torch.int64, device=device)
    blind_ranks = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    blind_ranks[dist.get_rank()] = blind[0]
    comm.all_reduce(blind_ranks)
    if dist.get_rank() == 0:
        os.remove(path)
    if blind_ranks.any():
        raise CheckpointError(f"ranks {blind_ranks.nonzero().flatten().tolist()} do not see rank 0's file in "
                              f"{directory}: several nodes must save onto a shared filesystem (the same folder "
                              f"on every node)")


def process_start(pid: int) -> str | None:
    """When process ``pid`` started: field 22 of ``/proc/PID/stat`` (clock ticks after boot; proc(5)), or None
    without /proc or such a process. A pid alone may be reused by another program; the pair names one
    process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]    # the name, in parentheses, may hold spaces
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                                   # someone else's process: alive
        return True
    return True


def _read_lock(path: str) -> dict | None:
    """The lock's holder, or None while it is empty or not a holder (being written, or garbage)."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def _stale(path: str, holder: dict | None, host: str) -> bool:
    """Nobody holds the lock any more: unreadable for :data:`UNREADABLE_LOCK_SECONDS` (a writer fills it at
    once), or held on this host by a pid that is dead or now another process (its start time differs)."""
    if holder is None:
        try:
            return time.time() - os.stat(path).st_mtime > UNREADABLE_LOCK_SECONDS
        except FileNotFoundError:
            return True
    if holder.get("host", "?") != host:                       # another host's process cannot be asked
        return False
    started, now = holder.get("started"), process_start(holder["pid"])
    return not _alive(holder["pid"]) or (started is not None and now is not None and now != started)


def lock_folder(directory: str, wait: float = 0.0) -> str:
    """Make ``directory`` this run's while it writes: create ``directory/.minipar-lock`` (``O_EXCL``: one
    creator wins) holding this process's pid, start time (:func:`process_start`) and host; returns its path.
    Held by a live run (or by one on another host, which cannot be asked): wait up to ``wait`` seconds for it
    to go, then :class:`CheckpointError` naming it. Left by a dead process on this host (killed before it
    could remove it), naming a pid another program now has, or empty or garbage for
    :data:`UNREADABLE_LOCK_SECONDS`: taken over."""
    path = os.path.join(directory, LOCK)
    me = {"pid": os.getpid(), "started": process_start(os.getpid()), "host": socket.gethostname(),
          "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    deadline, takeovers = time.monotonic() + wait, 0
    while takeovers < 3:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if _stale(path, holder, me["host"]):
                try:
                    os.remove(path)                           # a killed run's lock: nobody writes any more
                except FileNotFoundError:
                    pass
                takeovers += 1
                continue
            if holder is None:                                # being written this instant: a run is starting
                time.sleep(0.2)
                continue
            if time.monotonic() < deadline:                   # --wait-for-lock: the holder may finish
                time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
                continue
            raise CheckpointError(
                f"--save {directory} is in use by pid {holder['pid']} on host {holder.get('host', '?')} (since "
                f"{holder.get('since', '?')}; lock {path}): two runs writing one folder replace each other's "
                f"checkpoints; wait for that run (--wait-for-lock SECONDS), choose another folder, or remove "
                f"{path} if that run is gone"
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    raise CheckpointError(f"--save {directory}: could not take its lock {path} (other runs keep taking it)")


def unlock_folder(path: str) -> None:
    """Remove the lock :func:`lock_folder` took, if it is still this process's."""
    if (_read_lock(path) or {}).get("pid") == os.getpid():
        os.remove(path)


def write_failed(exc: BaseException, path: str, directory: str) -> BaseException:
    """The error to raise when writing ``path`` of a checkpoint in ``directory`` raised ``exc``: for a full
    disk or file-size limit (``ENOSPC``/``EFBIG``/``EDQUOT``, or torch.save's "unexpected pos" short write)
    a :class:`CheckpointError` saying so, naming the file and the checkpoint ``latest`` still names;
    anything else unchanged."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if getattr(exc, "errno", None) not in FULL and "unexpected pos" not in text:
        return exc
    try:
        with open(os.path.join(directory, "latest")) as f:
            still = f"{directory}/latest still names {f.read().strip()}, the last complete checkpoint"
    except OSError:
        still = f"{directory} holds no complete checkpoint yet (no latest)"
    return CheckpointError(f"cannot write {path}: the disk (or the file-size limit) is full ({text}); "
                           f"{still}; free space and resume")

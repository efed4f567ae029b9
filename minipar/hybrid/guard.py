"""What must hold before a 3D run trains: the checkpoint it resumes is of the same run, the folder it saves into
can be written, holds no other run's checkpoint, and is the same folder on every rank that writes.

A run is its model config, seed, dtype and data stream (:func:`run_identity`); a checkpoint's manifest records
them (:mod:`minipar.hybrid.checkpoint`), so :func:`differences` can list what a resume would silently change —
four layers loaded into two, another seed — and the command refuses it before any process starts.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import comm
__all__ = ["CheckpointError", "barrier", "run_identity", "differences", "check_folder", "check_shared"]


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

"""Chapter 02's measured runs: the per-rank functions the notebook launches, kept out of its teaching cells.

Each function runs on one rank (``minipar.launch(fn, N, ...)``) and returns what that rank saw: the training
result, compared in the notebook with one device, and what the communication log counted.

* :func:`ps_traffic` — a synchronous parameter server's training and this rank's bytes sent per step;
* :func:`ddp_with_bytes` — minipar's DDP, bytes sent and all-reduces per step;
* :func:`ours_vs_torch` — minipar's DDP and ``torch.nn.parallel.DistributedDataParallel`` side by side on
  the same shards: the largest gradient and parameter differences;
* :func:`accumulation` — DDP with k = 1 and k = 4 micro-batches per step (``no_sync`` for the first k-1);
* :func:`timeline_summary` — one rank's DDP timeline (from :func:`.figures.ddp_timeline`) in four numbers.
"""
from __future__ import annotations

import torch.nn as nn

from minipar import comm
from minipar.data import ddp
from minipar.data import parameter_server as ps
from minipar.loop import shard_batch

__all__ = ["ps_traffic", "ddp_with_bytes", "ours_vs_torch", "accumulation", "timeline_summary"]


def ps_traffic(rank, world_size, recipe):
    """(RunResult, bytes this rank sent per step) under the parameter server (rank 0 is the server)."""
    log = comm.CommLog()
    res = ps.parallel_train(rank, world_size, recipe, step_log=log)
    return res, log.bytes_sent / recipe.steps


def ddp_with_bytes(rank, world_size, recipe, **kwargs):
    """(RunResult, bytes sent per step, all-reduces per step) under minipar's DDP."""
    log = comm.CommLog()
    res = ddp.parallel_train(rank, world_size, recipe, step_log=log, **kwargs)
    return res, log.bytes_sent / recipe.steps, log.count("all_reduce") / recipe.steps


def ours_vs_torch(rank, world_size, recipe, bucket_bytes):
    """Two copies of the model on this rank, one in minipar's DDP and one in torch's, trained on the same
    shards: (max |Δ gradient| over the steps, max |Δ parameter| at the end)."""
    a, b = recipe.model(), recipe.model()
    ours = ddp.DistributedDataParallel(a, bucket_bytes=bucket_bytes)
    theirs = nn.parallel.DistributedDataParallel(b, bucket_cap_mb=bucket_bytes / 2**20)
    opts = [recipe.optimizer(a.parameters()), recipe.optimizer(b.parameters())]
    grad_diff = 0.0
    for batch in recipe.batches:
        xs, ys = shard_batch(batch, rank, world_size)
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad(set_to_none=True)
            recipe.loss(m, xs, ys).backward()
        grad_diff = max([grad_diff] + [(p.grad - q.grad).abs().max().item()
                                       for p, q in zip(a.parameters(), b.parameters())])
        for opt in opts:
            opt.step()
    return grad_diff, max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def accumulation(rank, world_size, recipe, ks=(1, 4), bucket_bytes=16 * 1024):
    """[(k, RunResult, bytes sent per optimizer step, all-reduces per step)] for k micro-batches per step."""
    rows = []
    for k in ks:
        log = comm.CommLog()
        res = ddp.parallel_train(rank, world_size, recipe, bucket_bytes=bucket_bytes, accum_steps=k, step_log=log)
        rows.append((k, res, log.bytes_sent / recipe.steps, log.count("all_reduce") / recipe.steps))
    return rows


def timeline_summary(events) -> dict:
    """One rank's step: buckets launched, ms into backward of the first launch and of the last gradient,
    ms at which backward returned (every bucket reduced), and the share of comm time hidden by compute."""
    from .figures import overlap_fraction
    (b0, b1), = [(a, b) for k, _, a, b in events if k == "backward"]
    launches = [a for k, _, a, _ in events if k == "comm"]
    last_grad = max(a for k, _, a, _ in events if k == "grad")
    return {"buckets": len(launches), "first_launch_ms": 1e3 * (min(launches) - b0),
            "last_grad_ms": 1e3 * (last_grad - b0), "reduced_ms": 1e3 * (b1 - b0),
            "hidden": overlap_fraction(events)}

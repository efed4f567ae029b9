"""Chapter 02's measured runs: the per-rank functions the notebook launches, kept out of its teaching cells.

Each function runs on one rank (``minipar.launch(fn, N, ...)``) and returns what that rank saw: the training
result, compared in the notebook with one device, and what the communication log counted.

* :func:`run_and_count` — any strategy's ``parallel_train`` on N ranks, bytes sent and all-reduces per step;
* :func:`ours_vs_torch` (launched by :func:`against_torch_ddp`) — minipar's DDP and
  ``torch.nn.parallel.DistributedDataParallel`` side by side on the same shards: the largest gradient and
  parameter differences;
* :func:`timeline_summary` — one rank's DDP timeline (from :func:`.figures.ddp_timeline`) in four numbers;
* :func:`unused_branch` — a model with a branch no rank takes, under minipar's DDP without and with
  ``find_unused_parameters``: the error, then the comparison with one device;
* :func:`threads_vs_one_thread` — DataParallel's replica forwards on threads against the same forwards one
  after another on one thread (the GIL's baseline), in this process.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn as nn

from minipar import comm, launch
from minipar.check import compare, train_reference
from minipar.recipe import Recipe
from minipar.data import ddp
from minipar.loop import shard_batch

__all__ = ["run_and_count", "against_torch_ddp", "ours_vs_torch", "timeline_summary", "threads_vs_one_thread",
           "unused_branch"]


def run_and_count(parallel_train, world_size: int, recipe, **kwargs) -> list:
    """Launch a strategy's ``parallel_train(rank, world_size, recipe, step_log=..., **kwargs)`` on ``world_size``
    ranks with every rank's messages logged: per rank (RunResult, bytes sent per step, all-reduces per step)."""
    return launch(_counted, world_size, parallel_train, recipe, kwargs, quiet=True)


def _counted(rank, world_size, parallel_train, recipe, kwargs):
    log = comm.CommLog()
    res = parallel_train(rank, world_size, recipe, step_log=log, **kwargs)
    return res, log.bytes_sent / recipe.steps, log.count("all_reduce") / recipe.steps


def against_torch_ddp(world_size: int, recipe, bucket_bytes: int) -> list:
    """Per rank: :func:`ours_vs_torch` on ``world_size`` ranks."""
    return launch(ours_vs_torch, world_size, recipe, bucket_bytes, quiet=True)


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


def timeline_summary(events) -> dict:
    """One rank's step: buckets launched, ms into backward of the first launch and of the last gradient (where
    the drawn backward ends), ms at which ``loss.backward()`` returned (every bucket reduced: the end of the
    drawn wait)."""
    (b0, _), = [(a, b) for k, _, a, b in events if k == "backward"]
    (_, b1), = [(a, b) for k, _, a, b in events if k == "wait"]
    launches = [a for k, _, a, _ in events if k == "comm"]
    last_grad = max(a for k, _, a, _ in events if k == "grad")
    return {"buckets": len(launches), "first_launch_ms": 1e3 * (min(launches) - b0),
            "last_grad_ms": 1e3 * (last_grad - b0), "reduced_ms": 1e3 * (b1 - b0)}


def threads_vs_one_thread(recipe, devices: int, runs: int = 6) -> dict:
    """{"one_thread": [s], "threads": [s]}, ``runs`` of each after a warm-up: wall seconds of the forwards of
    the first global batch's ``devices`` shards run one after another on one thread (the baseline, through the same
    ``functional_call`` as each replica's thread, so the two differ in the threads only), and of
    :class:`minipar.data.dp.DataParallel`'s replica threads on the same shards (first start to last end of
    :attr:`minipar.data.dp.ExchangeLog.spans`). Both with one intra-op thread per forward, as ``dp.run``.
    ``"other_cores"``: other processes' CPU meanwhile, in cores (:class:`~minipar.observe.busy.OtherWork`)."""
    from torch.func import functional_call
    from minipar.data import dp
    from minipar.observe.busy import OtherWork
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    chunks = recipe.batches[0][0].chunk(devices)
    model = recipe.model()
    weights = dict(model.named_parameters())
    before = torch.get_num_threads()
    with OtherWork() as other:                      # other processes' CPU meanwhile: did a thread wait for a core?
        torch.set_num_threads(1)
        try:
            one = []
            for _ in range(runs + 1):
                start = time.perf_counter()
                for chunk in chunks:                  # the replicas' own call (dp._parallel_apply), on one thread
                    functional_call(model, weights, (chunk,))
                one.append(time.perf_counter() - start)
        finally:
            torch.set_num_threads(before)
        logs = []
        dp.run(dataclasses.replace(recipe, batches=[recipe.batches[0]] * (runs + 1)), devices=devices, step_logs=logs)
    threads = [max(e for _, _, e in log.spans) - min(s for _, s, _ in log.spans) for log in logs]
    return {"one_thread": one[1:], "threads": threads[1:], "other_cores": other.cores}


class TwoBranches(nn.Module):
    """Two linear branches; forward takes only ``used``, so ``unused`` gets no gradient on any rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x):
        return self.used(x)


def _squared_error(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def branch_recipe() -> Recipe:
    """One SGD step of :class:`TwoBranches` on a fixed batch of 8 rows, squared error."""
    x = torch.arange(32.0).reshape(8, 4) / 10
    return Recipe(TwoBranches, [(x, x.sum(1, keepdim=True))], optimizer=_sgd, loss=_squared_error)


def _branch_rank(rank, world_size, recipe):
    """Both runs on one rank: without the option, the error it raises; with it, the trained result."""
    out = []
    for find_unused in (False, True):
        try:
            out.append(ddp.parallel_train(rank, world_size, recipe, find_unused_parameters=find_unused))
        except RuntimeError as e:
            out.append(str(e))
    return out


def unused_branch(world_size: int = 2) -> tuple:
    """:func:`branch_recipe` on ``world_size`` ranks (one launch): (each rank's error, naming the rank and the
    parameters, without ``find_unused_parameters``; the comparison with one device, with it)."""
    recipe = branch_recipe()
    runs = launch(_branch_rank, world_size, recipe, quiet=True)
    return [error for error, _ in runs], compare(train_reference(recipe), [result for _, result in runs])

"""Chapter 02 in the tour: DataParallel (threads), a parameter server, and DDP, on the tiny GPT.

Every row trains :func:`minipar.check.gpt_recipe` (2 layers, Adam, 3 steps, global batch 8) and compares
losses and parameters with one device (float32 default tolerances of :mod:`minipar.check`). Bytes: what one
rank (one device, for DP) sends per optimizer step, mean over ranks: the communication log's model and, for
the multi-process strategies, what the sockets really carried (:mod:`minipar.wire`; DP's copies stay in
one process and have no wire), next to the formula:

* DP: the five exchanges / N (device 0 sends (N-1)·P for the replicas; the others send P of gradients);
* parameter server: the server's own bytes, (N-1)·P (the pull to N-1 workers; the row shows rank 0, not
  the mean, which would equal DDP's and hide the bottleneck); the workers' P each in the note;
* DDP: 2(N-1)/N · G per rank (ring all-reduce of the gradients), in any number of buckets, with or
  without gradient accumulation (no_sync), halved with a bf16 wire.

Peak memory: the live tensors of one more training step on rank 0 (minipar.memory.measure_step).
"""
from __future__ import annotations

import functools

import torch

from minipar import comm
from minipar.check import compare, gpt_recipe, train_reference
from minipar.data import ddp, dp, parameter_server as ps
from minipar.launcher import launch
from minipar.memory import measure_step
from minipar.loop import shard_batch
from minipar.course.tour import WORLD_SIZE, TourRow

BUCKET = 16 * 1024


def _recipe():
    return gpt_recipe(steps=3, batch_size=8)


def _grad_bytes(recipe) -> int:
    return sum(p.numel() * p.element_size() for p in recipe.model().parameters())


def _dp() -> TourRow:
    recipe = _recipe()
    logs: list = []
    result = dp.run(recipe, devices=WORLD_SIZE, step_logs=logs)
    c = compare(train_reference(recipe), [result])
    x, _ = recipe.batches[0]
    out_bytes = x.numel() * recipe.model().cfg.vocab_size * 4
    formula = dp.predicted_exchange_bytes(WORLD_SIZE, _grad_bytes(recipe), x.numel() * x.element_size(), out_bytes)
    measured = sum(log.bytes for log in logs) / len(logs)
    return TourRow("DP (threads, nn.DataParallel-style)", WORLD_SIZE, c.matches, c.max_abs_diff,
                   measured / WORLD_SIZE, sum(formula.values()) / WORLD_SIZE, None,
                   note="5 exchanges, all through device 0; replicate+reduce = 2(N-1)·P")


def _rank(rank, world_size, recipe, train_fn, **kwargs):
    log = comm.CommLog()
    result = train_fn(rank, world_size, recipe, step_log=log, **kwargs)
    steps = recipe.steps
    observed = None if log.observed_bytes_sent is None else log.observed_bytes_sent / steps
    return (result, log.bytes_sent / steps, _peak(rank, world_size, recipe, train_fn, kwargs), observed,
            log.count() / steps)


def _peak(rank, world_size, recipe, train_fn, kwargs) -> int:
    """Peak live bytes of one more step on this rank (model, grads, optimizer, activations; for DDP
    plus its bucket buffers, allocated once at construction)."""
    model, buffers = recipe.model(), 0
    if train_fn is ddp.parallel_train:
        keep = {k: v for k, v in kwargs.items() if k in ("bucket_bytes", "comm_dtype")}
        wrapped = ddp.DistributedDataParallel(model, **keep)
        buffers = sum(b.buffer.numel() * b.buffer.element_size() for b in wrapped.reducer.buckets)
    else:
        wrapped = model
    opt = recipe.optimizer(model.parameters())
    x, y = shard_batch(recipe.batches[0], rank, world_size)

    def step():
        recipe.loss(wrapped, x, y).backward()
        if train_fn is ps.parallel_train:
            ps.push_gradients(list(model.parameters()), 0)
            if rank == 0:
                opt.step()
            ps.pull_weights(list(model.parameters()), 0)
        else:
            opt.step()
    return measure_step(step, model.parameters(), opt).peak + buffers


def _multi(name, train_fn, formula_fn, note, recipe=None, tolerance=(None, None), server=False,
           **kwargs) -> TourRow:
    """One multi-process row: bytes per rank per step, mean over ranks — or, with ``server``, rank 0's
    (the parameter server's, whose link carries (N-1)·P: the mean would hide it)."""
    recipe = recipe or _recipe()
    reference = train_reference(recipe)
    out = launch(_rank, WORLD_SIZE, recipe, train_fn, quiet=True, **kwargs)
    c = compare(reference, [o[0] for o in out], *tolerance)
    mean = lambda i: sum(o[i] for o in out) / len(out)  # noqa: E731
    observed = None if any(o[3] is None for o in out) else ([o[3] for o in out] if server else mean(3))
    g = _grad_bytes(recipe)
    if server:
        workers = [round(o[3]) for o in out[1:]] if observed is not None else "-"
        return TourRow(name, WORLD_SIZE, c.matches, c.max_abs_diff, out[0][1], (WORLD_SIZE - 1) * g, out[0][2],
                       note=note.format(p=g, workers=workers, mean=mean(1)),
                       bytes_observed_per_rank=None if observed is None else observed[0],
                       calls_per_rank=out[0][4])
    return TourRow(name, WORLD_SIZE, c.matches, c.max_abs_diff, mean(1), formula_fn(g), out[0][2], note=note,
                   bytes_observed_per_rank=observed, calls_per_rank=mean(4))


def _ring(g, factor=1.0):
    return 2 * (WORLD_SIZE - 1) / WORLD_SIZE * g * factor


STRATEGIES = [
    ("DP threads", _dp),
    ("parameter server", functools.partial(
        _multi, "parameter server: the server (rank 0)", ps.parallel_train, _ring,
        "bytes of the server alone, (N-1)·P per step (P = {p} B): its link carries what all-reduce spreads "
        "over N; each worker sends P (observed {workers} B); the mean over ranks, {mean:.0f} B, would equal "
        "DDP's 2(N-1)/N·P and hide that", server=True)),
    ("DDP", functools.partial(
        _multi, f"DDP ({BUCKET // 1024} KiB buckets)", ddp.parallel_train, _ring,
        "one ring all-reduce per bucket, launched during backward", bucket_bytes=BUCKET)),
    ("DDP no_sync", functools.partial(
        _multi, "DDP + accumulation x2 (no_sync)", ddp.parallel_train, _ring,
        "2 micro-batches, one all-reduce per step", bucket_bytes=BUCKET, accum_steps=2)),
    ("DDP bf16 wire", functools.partial(
        _multi, "DDP, bf16 on the wire (SGD)", ddp.parallel_train, functools.partial(_ring, factor=0.5),
        "gradients rounded to bf16 for the all-reduce: bf16 tolerance 2e-2",
        recipe=gpt_recipe(steps=3, batch_size=8, optimizer="sgd"), tolerance=(2e-2, 2e-2),
        bucket_bytes=BUCKET, comm_dtype=torch.bfloat16)),
]

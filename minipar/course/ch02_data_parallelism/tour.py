"""Chapter 02 in the tour: DataParallel (threads), a parameter server, and DDP, on the tiny GPT.

Every row trains :func:`minipar.check.gpt_recipe` (2 layers, Adam, 3 steps, global batch 8) and compares
losses and parameters with one device (float32 default tolerances of :mod:`minipar.check`). Bytes: what one
rank (one device, for DP) sends per optimizer step, mean over ranks, measured (the communication log for
the multi-process strategies, the copies for DP), next to the formula:

* DP: the five exchanges / N (device 0 sends (N-1)·P for the replicas; the others send P of gradients);
* parameter server: ((N-1)·P from the server + (N-1)·P from the workers) / N; the server alone sends
  (N-1)·P, shown in the note;
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
    return result, log.bytes_sent / recipe.steps, _peak(rank, world_size, recipe, train_fn, kwargs)


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


def _multi(name, train_fn, formula_fn, note, recipe=None, tolerance=(None, None), **kwargs) -> TourRow:
    recipe = recipe or _recipe()
    reference = train_reference(recipe)
    out = launch(_rank, WORLD_SIZE, recipe, train_fn, quiet=True, **kwargs)
    c = compare(reference, [r for r, _, _ in out], *tolerance)
    sent = [s for _, s, _ in out]
    return TourRow(name, WORLD_SIZE, c.matches, c.max_abs_diff, sum(sent) / len(sent),
                   formula_fn(_grad_bytes(recipe)), out[0][2], note=note.format(server=sent[0]))


def _ring(g, factor=1.0):
    return 2 * (WORLD_SIZE - 1) / WORLD_SIZE * g * factor


STRATEGIES = [
    ("DP threads", _dp),
    ("parameter server", functools.partial(
        _multi, "parameter server (rank 0)", ps.parallel_train, _ring,
        "server sends {server:.0f} B = (N-1)·P; a worker sends P")),
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

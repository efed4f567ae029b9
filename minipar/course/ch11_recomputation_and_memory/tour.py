"""Chapter 11 in the tour: DDP on 4 ranks with activation recomputation (none / selective / full).

Every row trains a longer-sequence tiny GPT (3 layers, s = 64, Adam, 3 steps, float64) with
:mod:`minipar.data.ddp`, the model's blocks checkpointed by :func:`minipar.recompute.apply_recompute`, and
compares losses and parameters with one device without recomputation (float64 default tolerances:
recomputation itself is bit-exact, the all-reduce's summation order is what the tolerance is for; in
float32, Adam turns that order into differences of 3e-5, above float32's default tolerance).
Bytes: DDP's all-reduce, 2·8Ψ·(N-1)/N per rank per step — recomputation changes no communication: the log's
model and what the sockets carried (:mod:`minipar.wire`), mean over ranks.
Peak memory: one training step on rank 0's shard, measured with :func:`minipar.memory.measure_step`
(model states + the peak of what the step allocated): it falls from none to selective to full.
"""
from __future__ import annotations

import torch

from minipar import comm
from minipar.check import compare, gpt_recipe, train_reference
from minipar.data import ddp
from minipar.loop import shard_batch
from minipar.launcher import launch
from minipar.memory import measure_step
from minipar.recompute import activation_bytes_per_block, apply_recompute
from minipar.course.tour import WORLD_SIZE, TourRow


def _recipe(mode="none"):
    recipe = gpt_recipe(steps=3, batch_size=8, seq_len=64, block_size=64, n_layer=3, n_embd=64)
    make = recipe.model
    recipe.model = lambda: apply_recompute(make(), mode)
    recipe.dtype = torch.float64
    return recipe


def _rank(rank, world_size, recipe):
    log = comm.CommLog()
    result = ddp.parallel_train(rank, world_size, recipe, step_log=log)
    observed = None if log.observed_bytes_sent is None else log.observed_bytes_sent / recipe.steps
    return result, log.bytes_sent / recipe.steps, observed, log.count() / recipe.steps


def _peak(recipe) -> int:
    model = recipe.model().to(recipe.dtype)
    opt = recipe.optimizer(model.parameters())
    x, y = shard_batch(recipe.batches[0], 0, WORLD_SIZE)

    def step():
        recipe.loss(model, x, y).backward()
        opt.step()
    measure_step(step, model.parameters(), opt)                  # creates grads and Adam state
    opt.zero_grad(set_to_none=True)
    return measure_step(step, model.parameters(), opt).peak


def _row(mode: str) -> TourRow:
    reference = train_reference(_recipe("none"))
    recipe = _recipe(mode)
    out = launch(_rank, WORLD_SIZE, recipe, quiet=True)
    c = compare(reference, [o[0] for o in out], dtype=recipe.dtype)
    mean = lambda i: sum(o[i] for o in out) / len(out)  # noqa: E731
    psi = sum(p.numel() for p in recipe.model().parameters())
    cfg = recipe.model().cfg
    per_block = activation_bytes_per_block(cfg, mode, 8 // WORLD_SIZE, 64, recipe.dtype)
    return TourRow(f"DDP + recompute {mode}", WORLD_SIZE, c.matches, c.max_abs_diff,
                   mean(1), comm.predicted_bytes_sent("all_reduce", 8 * psi, WORLD_SIZE),
                   _peak(recipe), note=f"activations kept per block: {per_block / 1024:.0f} KiB (measured)",
                   bytes_observed_per_rank=None if any(o[2] is None for o in out) else mean(2),
                   calls_per_rank=mean(3))


STRATEGIES = [(f"DDP + recompute {mode}", lambda mode=mode: _row(mode)) for mode in ("none", "selective", "full")]

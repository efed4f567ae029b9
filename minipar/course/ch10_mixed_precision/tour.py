"""Chapter 10 in the tour: mixed precision under data parallelism, on the tiny GPT, 4 ranks.

Reference: the same recipe trained with mixed precision on one device (:func:`train_mixed`: FP32 masters,
16-bit compute, the loss scaler for FP16). Tolerance 1e-3 (FP16) / 5e-3 (BF16) on losses and FP32 masters
after 3 SGD steps: the 16-bit gradients are summed over ranks in another order and rounded on the way (see
tests/test_mixed_precision_parallel.py for why SGD, not Adam, and what was measured).

Bytes sent per rank per step, measured in the communication log, next to the formula:
* DDP, FP16 wire: all-reduce of 2-byte gradients, 2·2Ψ·(N-1)/N (half of FP32 DDP's);
* ZeRO-2, BF16: reduce-scatter of 2-byte gradients + all-gather of 2-byte parameters, 2·2Ψ'·(N-1)/N
  (Ψ' = Ψ padded per unit).
Observed: what each rank really wrote to its sockets per step (:mod:`minipar.wire`), mean over ranks; under
FP16 it includes the 4-byte all-reduce of the overflow flag the formula leaves out (a few hundred bytes with
gloo's framing). Peak: one more training step per rank, measured (model states + the peak the step
allocated, max over ranks).
"""
from __future__ import annotations

import torch

from minipar import comm
from minipar.check import compare, gpt_recipe
from minipar.data import zero_memory
from minipar.launcher import launch
from minipar.data.ddp import DistributedDataParallel
from minipar.data.zero import ZeRO, block_units
from minipar.data.zero_measure import measure_peak
from minipar.loop import shard_batch
from minipar.memory import measure_step
from minipar.precision.mixed import (MixedPrecision, ddp_parallel_train, fp32_loss, train_mixed,
                                     zero_parallel_train)
from minipar.course.tour import WORLD_SIZE, TourRow

TOL = {torch.float16: 1e-3, torch.bfloat16: 5e-3}


def _recipe():
    return gpt_recipe(steps=3, batch_size=8, optimizer="sgd")


def _rank(rank, world_size, fn, recipe, dtype):
    log = comm.CommLog()
    result = fn(rank, world_size, recipe, dtype, step_log=log)
    return result, log.by_op(), log.observed_bytes_sent, log.count(), _peak(rank, world_size, fn, recipe, dtype)


def _peak(rank, world_size, fn, recipe, dtype) -> int:
    """Peak live bytes of one more training step on this rank (after a first step created the gradients
    and the optimizer state): model states (16-bit compute copy, FP32 masters, optimizer state) + the peak
    of what the step allocated (activations, 16-bit and FP32 gradients; DDP's bucket buffers)."""
    x, y = shard_batch(recipe.batches[0], rank, world_size)
    if fn is ddp_parallel_train:
        mp = MixedPrecision(recipe.model(), recipe.optimizer, dtype)
        wrapped = DistributedDataParallel(mp.model, comm_dtype=dtype)
        buffers = sum(b.buffer.numel() * b.buffer.element_size() for b in wrapped.reducer.buckets)
        step = lambda: mp.train_step(fp32_loss, x, y, module=wrapped)  # noqa: E731
        measure_step(step, [*mp.compute, *mp.master], mp.optimizer)          # creates the Adam/SGD state
        return measure_step(step, [*mp.compute, *mp.master], mp.optimizer).peak + buffers
    model = recipe.model()
    zero = ZeRO(model, recipe.optimizer, 2, None, block_units(model), param_dtype=dtype)

    def step():
        zero.zero_grad()
        fp32_loss(model, x, y).backward()
        zero.step()
    step()
    return measure_peak(zero, step)[1]


def _row(name, fn, dtype, formula_fn, note) -> TourRow:
    recipe = _recipe()
    reference, _ = train_mixed(recipe, dtype)
    out = launch(_rank, WORLD_SIZE, fn, recipe, dtype, quiet=True)
    c = compare(reference, [o[0] for o in out], atol=TOL[dtype], rtol=TOL[dtype])
    sent = [sum(b for op, (_, b) in by_op.items() if op != "all_reduce" or fn is ddp_parallel_train)
            for _, by_op, *_ in out]
    steps = recipe.steps
    observed = None if any(o[2] is None for o in out) else sum(o[2] for o in out) / len(out) / steps
    psi = sum(p.numel() for p in recipe.model().parameters())
    return TourRow(name, WORLD_SIZE, c.matches, c.max_abs_diff, sum(sent) / len(sent) / steps,
                   formula_fn(recipe, psi), max(o[4] for o in out), note=note,
                   bytes_observed_per_rank=observed, calls_per_rank=sum(o[3] for o in out) / len(out) / steps)


def _ddp_fp16() -> TourRow:
    return _row("DDP + FP16 mixed precision (FP16 wire)", ddp_parallel_train, torch.float16,
                lambda recipe, psi: comm.predicted_bytes_sent("all_reduce", 2 * psi, WORLD_SIZE),
                "loss scale 2^16, FP32 masters per rank; all-reduce of 2-byte grads = half FP32 DDP")


def _zero2_bf16() -> TourRow:
    def formula(recipe, psi):
        model, claimed, numels = recipe.model(), set(), []
        for module in block_units(model):
            mine = [p for p in module.parameters() if p not in claimed]
            claimed.update(mine)
            numels.append(sum(p.numel() for p in mine))
        return zero_memory.bytes_sent_per_step(zero_memory.padded_numel(numels, WORLD_SIZE), WORLD_SIZE, 2,
                                               "mixed")
    return _row("ZeRO-2 + BF16 (FP32 master shards)", zero_parallel_train, torch.bfloat16, formula,
                "no loss scaling; reduce-scatter 2-byte grads + all-gather 2-byte params; on the wire ~1.5x the "
                "formula: gloo's reduce-scatter all-reduces the whole buffer (chapter 03's ring rows send the "
                "formula's bytes)")


STRATEGIES = [("DDP + FP16 mixed precision (FP16 wire)", _ddp_fp16),
              ("ZeRO-2 + BF16 (FP32 master shards)", _zero2_bf16)]

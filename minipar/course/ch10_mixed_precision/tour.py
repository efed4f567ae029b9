"""Chapter 10 in the tour: mixed precision under data parallelism, on the tiny GPT, 4 ranks.

Reference: the same recipe trained with mixed precision on one device (:func:`train_mixed`: FP32 masters,
16-bit compute, the loss scaler for FP16). Tolerance 1e-3 (FP16) / 5e-3 (BF16) on losses and FP32 masters
after 3 SGD steps: the 16-bit gradients are summed over ranks in another order and rounded on the way (see
tests/test_mixed_precision_parallel.py for why SGD, not Adam, and what was measured).

Bytes sent per rank per step, measured in the communication log, next to the formula:
* DDP, FP16 wire: all-reduce of 2-byte gradients, 2·2Ψ·(N-1)/N (half of FP32 DDP's);
* ZeRO-2, BF16: reduce-scatter of 2-byte gradients + all-gather of 2-byte parameters, 2·2Ψ'·(N-1)/N
  (Ψ' = Ψ padded per unit).
Peak memory is chapter 11's subject and is not measured in these rows.
"""
from __future__ import annotations

import torch

from minipar import comm
from minipar.check import compare, gpt_recipe
from minipar.data import zero_memory
from minipar.launcher import launch
from minipar.precision.mixed import ddp_parallel_train, train_mixed, zero_parallel_train
from minipar.course.tour import WORLD_SIZE, TourRow

TOL = {torch.float16: 1e-3, torch.bfloat16: 5e-3}


def _recipe():
    return gpt_recipe(steps=3, batch_size=8, optimizer="sgd")


def _rank(rank, world_size, fn, recipe, dtype):
    log = comm.CommLog()
    result = fn(rank, world_size, recipe, dtype, step_log=log)
    return result, log.by_op()


def _row(name, fn, dtype, formula_fn, note) -> TourRow:
    recipe = _recipe()
    reference, _ = train_mixed(recipe, dtype)
    out = launch(_rank, WORLD_SIZE, fn, recipe, dtype, quiet=True)
    c = compare(reference, [r for r, _ in out], atol=TOL[dtype], rtol=TOL[dtype])
    sent = [sum(b for op, (_, b) in by_op.items() if op != "all_reduce" or fn is ddp_parallel_train)
            for _, by_op in out]
    psi = sum(p.numel() for p in recipe.model().parameters())
    return TourRow(name, WORLD_SIZE, c.matches, c.max_abs_diff, sum(sent) / len(sent) / recipe.steps,
                   formula_fn(recipe, psi), None, note=note)


def _ddp_fp16() -> TourRow:
    return _row("DDP + FP16 mixed precision (FP16 wire)", ddp_parallel_train, torch.float16,
                lambda recipe, psi: comm.predicted_bytes_sent("all_reduce", 2 * psi, WORLD_SIZE),
                "loss scale 2^16, FP32 masters per rank; all-reduce of 2-byte grads = half FP32 DDP")


def _zero2_bf16() -> TourRow:
    def formula(recipe, psi):
        from minipar.data.zero import block_units
        model, claimed, numels = recipe.model(), set(), []
        for module in block_units(model):
            mine = [p for p in module.parameters() if p not in claimed]
            claimed.update(mine)
            numels.append(sum(p.numel() for p in mine))
        return zero_memory.bytes_sent_per_step(zero_memory.padded_numel(numels, WORLD_SIZE), WORLD_SIZE, 2,
                                               "mixed")
    return _row("ZeRO-2 + BF16 (FP32 master shards)", zero_parallel_train, torch.bfloat16, formula,
                "no loss scaling; reduce-scatter 2-byte grads + all-gather 2-byte params")


STRATEGIES = [("DDP + FP16 mixed precision (FP16 wire)", _ddp_fp16),
              ("ZeRO-2 + BF16 (FP32 master shards)", _zero2_bf16)]

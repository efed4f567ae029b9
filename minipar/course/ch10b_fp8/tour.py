"""Chapter 10b in the tour: the tiny GPT trained with FP8 block-wise GEMMs under DDP on 4 ranks.

FP8 (block-wise): every Linear's GEMMs in E4M3 with 1×128 activation tiles and 128×128 weight blocks, gradients
E5M2 (:class:`minipar.precision.fp8.FP8Recipe`), inside BF16 mixed precision (FP32 masters, Adam), DDP
all-reducing the BF16 gradients. FP8 rounds differently from BF16 by design, so ``matches`` is not equality:
it means the final loss (mean of the last :data:`TAIL` of :data:`STEPS` steps, every rank's mean loss) is within
:data:`GAP` (relative) of the same recipe trained in plain BF16 mixed precision on one device.
Bytes: the BF16 all-reduce of the gradients, 2·2Ψ·(N-1)/N per rank and step, logged and observed.
"""
from __future__ import annotations

import torch

from minipar import comm
from minipar.check import gpt_recipe
from minipar.course.tour import WORLD_SIZE, TourRow
from minipar.launcher import launch
from minipar.precision.fp8 import FP8Recipe
from minipar.precision.fp8_train import final_loss, fp8_training_recipe, loss_gap, train_bf16
from minipar.precision.mixed import ddp_parallel_train

STEPS, TAIL, GAP = 20, 5, 0.10


def recipe():
    """The tiny GPT widened to 128 so that a 1×128 tile and a 128×128 block are real (Adam, lr 1e-2)."""
    return gpt_recipe(steps=STEPS, batch_size=8, n_embd=128)


def _rank(rank, world_size, recipe):
    log = comm.CommLog()
    result = ddp_parallel_train(rank, world_size, recipe, torch.bfloat16, step_log=log)
    return result, log.bytes_sent, log.observed_bytes_sent, log.count()


def _fp8_blockwise() -> TourRow:
    base = recipe()
    bf16 = train_bf16(base)
    out = launch(_rank, WORLD_SIZE, fp8_training_recipe(base, FP8Recipe("block")), quiet=True)
    losses = out[0][0].losses
    gap = loss_gap(losses, bf16.losses, TAIL)
    psi = sum(p.numel() for p in base.model().parameters())
    observed = None if any(o[2] is None for o in out) else sum(o[2] for o in out) / len(out) / STEPS
    return TourRow("FP8 (block-wise)", WORLD_SIZE, abs(gap) <= GAP,
                   abs(final_loss(losses, TAIL) - final_loss(bf16.losses, TAIL)),
                   sum(o[1] for o in out) / len(out) / STEPS,
                   comm.predicted_bytes_sent("all_reduce", 2 * psi, WORLD_SIZE), None,
                   note=f"E4M3 GEMMs, 1x128 / 128x128 scales, E5M2 grads, in BF16 mixed precision, DDP; matches = "
                        f"final loss (last {TAIL} of {STEPS} Adam steps) within {GAP:.0%} of one-device BF16: "
                        f"gap {gap:+.2%}; max_abs_diff = the final losses' difference",
                   bytes_observed_per_rank=observed, calls_per_rank=sum(o[3] for o in out) / len(out) / STEPS)


STRATEGIES = [("FP8 (block-wise)", _fp8_blockwise)]

"""Chapter 10b in the tour: the tiny GPT trained with FP8 block-wise GEMMs under DDP on 4 ranks.

FP8 (block-wise): every Linear's GEMMs in E4M3 with 1×128 activation tiles and 128×128 weight blocks, gradients
E5M2 (:class:`minipar.precision.fp8.FP8Recipe`), inside BF16 mixed precision (FP32 masters), DDP all-reducing
the BF16 gradients. ``matches`` holds two checks:

* equality with one device: DDP on 4 ranks equals the same FP8 recipe on one device after :data:`EQUAL_STEPS`
  SGD steps, losses and FP32 masters within :data:`TOL` (chapter 10's BF16 tolerance: the ranks' gradients are
  rounded and summed in another order, and the weight gradient's 1×128 tiles run along each rank's tokens);
* the loss gap to BF16: over :data:`~minipar.course.ch10b_fp8.training.STEPS` Adam steps at lr
  :data:`~minipar.course.ch10b_fp8.training.LR` (stable for this model; at lr 1e-2 even FP32 and BF16 part by
  several percent) on one device, seed 0 of §5's one-block model, the final loss of FP8 block-wise is within
  :data:`GAP` (relative) of plain BF16 mixed precision's — DeepSeek-V3's 0.25 %. Chapter 10b's §5 measures it over several seeds beside
  BF16's own seed-to-seed spread.

Bytes: the BF16 all-reduce of the gradients, 2·2Ψ·(N-1)/N per rank and step, logged and observed.
"""
from __future__ import annotations

import torch

from minipar import comm
from minipar.check import compare, gpt_recipe
from minipar.course.tour import WORLD_SIZE, TourRow
from minipar.launcher import launch
from minipar.precision.fp8 import FP8Recipe
from minipar.precision.fp8_train import fp8_training_recipe, loss_gap, train_bf16, train_fp8
from minipar.precision.mixed import ddp_parallel_train, train_mixed

from . import training

GAP = training.DEEPSEEK_V3_GAP
EQUAL_STEPS, TOL = 3, 5e-3


def recipe(steps: int = training.STEPS, optimizer: str = "adam"):
    """The tiny GPT widened to 128 so that a 1×128 tile and a 128×128 block are real."""
    return gpt_recipe(steps=steps, batch_size=8, n_embd=128, optimizer=optimizer)


def _rank(rank, world_size, recipe):
    log = comm.CommLog()
    result = ddp_parallel_train(rank, world_size, recipe, torch.bfloat16, step_log=log)
    return result, log.bytes_sent, log.observed_bytes_sent, log.count()


def _fp8_blockwise() -> TourRow:
    block = FP8Recipe("block")
    short = fp8_training_recipe(recipe(EQUAL_STEPS, "sgd"), block)
    one_device, _ = train_mixed(short, torch.bfloat16)
    out = launch(_rank, WORLD_SIZE, short, quiet=True)
    c = compare(one_device, [o[0] for o in out], atol=TOL, rtol=TOL)
    long = training.seed_recipe(0)
    with training.one_thread():
        gap = loss_gap(train_fp8(long, block)[0].losses, train_bf16(long).losses, training.TAIL)
    psi = sum(p.numel() for p in recipe().model().parameters())          # the DDP run's model
    observed = None if any(o[2] is None for o in out) else sum(o[2] for o in out) / len(out) / EQUAL_STEPS
    return TourRow("FP8 (block-wise)", WORLD_SIZE, c.matches and abs(gap) <= GAP, c.max_abs_diff,
                   sum(o[1] for o in out) / len(out) / EQUAL_STEPS,
                   comm.predicted_bytes_sent("all_reduce", 2 * psi, WORLD_SIZE), None,
                   note=f"E4M3 GEMMs, 1x128 / 128x128 scales, E5M2 grads, in BF16 mixed precision, DDP; equals one "
                        f"device's FP8 within {TOL:g} ({EQUAL_STEPS} SGD steps); final loss over {training.STEPS} Adam "
                        f"steps (lr {training.LR:g}, seed 0) within {GAP:.2%} of BF16's: gap {gap:+.3%}",
                   bytes_observed_per_rank=observed, calls_per_rank=sum(o[3] for o in out) / len(out) / EQUAL_STEPS)


STRATEGIES = [("FP8 (block-wise)", _fp8_blockwise)]

"""Mixed precision under data parallelism trains like single-device mixed precision, and communicates in
16 bits.

Reference: :func:`train_mixed` on one device (FP16 with the dynamic loss scaler, or BF16), same recipe.
Parallel: DDP with ``comm_dtype`` = the 16-bit dtype, and ZeRO-2 with ``param_dtype`` = it (FP32 master
shards), on 2 ranks. Tolerance: atol = rtol = 1e-3 (FP16) and 5e-3 (BF16) on the loss at every step and on
every FP32 master weight after 4 SGD steps. Not exact, because the ranks' 16-bit gradients are summed in a
different order than one device's batch sum and rounded to 16 bits on the way (DDP and ZeRO both divide by
N before their 16-bit sum): each gradient differs by a few 16-bit roundings (FP16 eps 2^-10, BF16 2^-7),
and SGD moves the masters by lr times that (measured: 2e-5 for FP16, 1.4e-4 for BF16). SGD and not Adam:
Adam's update is about lr·sign(g) for a near-zero gradient, so a rounding that flips such a gradient's sign
moves the weight by 2·lr whatever the precision (measured 0.016 after 4 Adam steps) and the comparison
would test Adam, not the strategy. A wrong strategy (gradients summed and not averaged, not unscaled, a
step lost) is off by far more than the tolerance.

Bytes per rank and step, measured in minipar.comm's log: DDP all-reduces 2Ψ bytes (2·2Ψ·(N-1)/N sent,
half of FP32 DDP); ZeRO-2 reduce-scatters the 16-bit gradients and all-gathers the 16-bit parameters
(2·2Ψ'·(N-1)/N, Ψ' = Ψ padded per unit), plus one 4-byte all-reduce of the overflow flag under FP16.
ZeRO-2's model states per rank, measured: 2Ψ' bytes of 16-bit parameters, 4Ψ'/N of FP32 master shard and
4Ψ'/N of FP32 gradient shard.
"""
import dataclasses

import pytest
import torch

from minipar import comm, launch
from minipar.check import RunResult, compare, gpt_recipe
from minipar.data import zero_memory
from minipar.precision.loss_scaler import DynamicLossScaler
from minipar.precision.mixed import ddp_parallel_train, train_mixed, zero_parallel_train

N, STEPS = 2, 4
TOL = {torch.float16: 1e-3, torch.bfloat16: 5e-3}
STRATEGIES = {"ddp": ddp_parallel_train, "zero2": zero_parallel_train}


def _logged(rank, world_size, fn, recipe, dtype, **kw):
    log = comm.CommLog()
    result = fn(rank, world_size, recipe, dtype, step_log=log, **kw)
    return result, log.by_op()


@pytest.fixture(scope="module")
def recipe():
    return gpt_recipe(steps=STEPS, optimizer="sgd")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_trains_like_single_device_mixed_precision(recipe, dtype, name, no_leftover_processes):
    reference, _ = train_mixed(recipe, dtype)
    out = launch(_logged, N, STRATEGIES[name], recipe, dtype, quiet=True)
    compare(reference, [r for r, _ in out], atol=TOL[dtype], rtol=TOL[dtype]).assert_ok()
    psi = sum(p.numel() for p in recipe.model().parameters())
    for _, by_op in out:
        if name == "ddp":
            calls, sent = by_op["all_reduce"]
            formula = STEPS * comm.predicted_bytes_sent("all_reduce", 2 * psi, N)   # 2 bytes per gradient
            assert abs(sent - formula) <= calls, (sent, formula)                   # int() per bucket call
            assert set(by_op) == {"all_reduce"}
        else:
            padded = zero_memory.padded_numel([p.numel() for p in _units(recipe)], N)
            sent = by_op["reduce_scatter"][1] + by_op["all_gather"][1]
            assert sent == STEPS * zero_memory.bytes_sent_per_step(padded, N, 2, "mixed")
            flag = by_op.get("all_reduce", (0, 0))
            assert flag == ((STEPS, STEPS * 4) if dtype == torch.float16 else (0, 0))  # overflow flag, 4 B
    if name == "zero2":                  # the memory side: 16-bit full compute copy, FP32 master shard 1/N
        padded = zero_memory.padded_numel([p.numel() for p in _units(recipe)], N)
        for result, _ in out:
            assert result.state_bytes["params"] == 2 * padded              # 16-bit compute copy, whole
            assert result.state_bytes["optimizer"] == 4 * padded // N      # FP32 masters (SGD keeps no state)
            assert result.state_bytes["grads"] == 4 * padded // N          # FP32 gradient of my shard only


def _units(recipe):
    """Parameters grouped as ZeRO's block_units groups them (one flat tensor per unit)."""
    from minipar.data.zero import block_units
    model = recipe.model()
    claimed, flats = set(), []
    for module in block_units(model):
        mine = [p for p in module.parameters() if p not in claimed]
        claimed.update(mine)
        flats.append(torch.empty(sum(p.numel() for p in mine)))
    return flats


def _from_overflowing_scale(rank, world_size, fn, recipe):
    return fn(rank, world_size, recipe, torch.float16, scaler=dict(init_scale=2.0 ** 19))


def test_overflowing_steps_are_skipped_on_every_rank(recipe, no_leftover_processes):
    """ZeRO-2, FP16, from a scale of 2^19: the first two steps overflow (on one device only the first does: a rank's
    gradient of its half batch cancels less than the whole batch's, and already overflows in 16 bits
    before any sum). Every rank must skip them, although under ZeRO each sees only its shard's gradients,
    and a skipped step must leave no trace: the run then equals one device trained on the steps taken,
    from the scale the back-offs left (2^17)."""
    results = launch(_from_overflowing_scale, N, zero_parallel_train, recipe, quiet=True)
    for r in results:
        assert [(scale, overflow) for scale, overflow, _ in r.scaler_history] == \
            [(2.0 ** 19, True), (2.0 ** 18, True), (2.0 ** 17, False), (2.0 ** 17, False)]
    taken = dataclasses.replace(recipe, batches=recipe.batches[2:])
    reference, _ = train_mixed(taken, torch.float16, DynamicLossScaler(init_scale=2.0 ** 17))
    tail = [RunResult(r.losses[2:], r.params) for r in results]
    compare(reference, tail, atol=TOL[torch.float16], rtol=TOL[torch.float16]).assert_ok()

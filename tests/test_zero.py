"""ZeRO-1/2/3 (and stage 0 = DDP) against single-device Adam, against each other, and against the formulas."""
import contextlib

import pytest
import torch

from minipar import comm, launch
from minipar import wire
from minipar.check import RunResult, compare, gpt_recipe, mlp_recipe, train_reference
from minipar.data import zero, zero_memory
from minipar.data.zero import ZeRO
from minipar.data.zero_measure import measure_stages, measured_train

# 2 steps: the second uses Adam's state (m, v) from the first; 3 showed the same for ~40 % more CPU
RECIPE = gpt_recipe(steps=2, batch_size=8, seq_len=16, optimizer="adam")

# peak=False in every measured run here: no test of this module reads memory["peak"] (they read the model
# states, params / grads / optimizer, which are measured without it), and the live-tensor tracker behind
# the peak about doubles a small step's CPU (minipar.data.zero_measure.StepMeter).
NO_PEAK = {"peak": False}


def _every_stage_and_no_prefetch(rank, world_size, recipe):
    from minipar import comm
    from minipar.data import ddp
    runs = measure_stages(rank, world_size, recipe, **NO_PEAK)
    runs["3, no prefetch"] = measured_train(rank, world_size, recipe, stage=3, prefetch=False, **NO_PEAK)
    log = comm.CommLog()
    runs["minipar DDP"] = ddp.parallel_train(rank, world_size, recipe, step_log=log)
    runs["minipar DDP"].bytes_sent = log.bytes_sent / recipe.steps
    return runs


@pytest.fixture(scope="module")
def four_ranks():
    """Every stage on 4 ranks in one launch, measured: {stage: [per-rank ZeroRunResult]}."""
    results = launch(_every_stage_and_no_prefetch, 4, RECIPE, quiet=True)
    return {s: [r[s] for r in results] for s in results[0]}


@pytest.fixture(scope="module")
def reference():
    """RECIPE on one device, once for the four stages."""
    return train_reference(RECIPE)


@pytest.mark.parametrize("stage", zero.STAGES)
def test_every_stage_matches_single_device_adam(four_ranks, reference, stage):
    # Default FP32 tolerance (atol 2e-5, rtol 1e-4): the gradient sum over ranks is added in another order
    # than one device's batch mean; Adam divides by sqrt(v), which magnifies that on tiny gradients.
    compare(reference, four_ranks[stage]).assert_ok()


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_sharded_stages_equal_ddp_bit_for_bit(four_ranks, stage):
    # Sharding Adam's state is exact: the same summed gradient, the same element-wise update.
    ddp = four_ranks[0][0]
    reference = RunResult(ddp.losses, ddp.params)
    compare(reference, four_ranks[stage], atol=0, rtol=0).assert_ok()


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_every_stage_matches_minipar_ddp(four_ranks, stage):
    # minipar.data.ddp (bucketed all-reduce during backward) adds the ranks' gradients in its own order:
    # equal to float32 rounding, checked at the default FP32 tolerance.
    ddp = four_ranks["minipar DDP"][0]
    compare(RunResult(ddp.losses, ddp.params), four_ranks[stage]).assert_ok()
    # ZeRO-1/2 send what DDP sends (up to the padding of each unit); ZeRO-3 1.5x
    padding = four_ranks[stage][0].padded_numel - four_ranks[stage][0].numel
    factor = 1.5 if stage == 3 else 1.0
    assert abs(four_ranks[stage][0].bytes_sent[0] - factor * ddp.bytes_sent) <= factor * 2 * 4 * padding


@pytest.mark.parametrize("stage", zero.STAGES)
def test_model_state_bytes_match_the_formula_n4(four_ranks, stage):
    _check_bytes(four_ranks[stage], 4, stage)


def test_model_state_bytes_match_the_formula_n1_n2_n8():
    for n in (1, 2, 8):
        results = launch(measure_stages, n, gpt_recipe(steps=1, batch_size=8, seq_len=8), **NO_PEAK, quiet=True)
        for stage in zero.STAGES:
            _check_bytes([r[stage] for r in results], n, stage)


def _check_bytes(per_rank, n, stage):
    for res in per_rank:
        psi, padded = res.numel, res.padded_numel
        assert padded - psi < n * 4                     # at most N-1 padding elements per unit (4 units)
        want = zero_memory.model_state_bytes_formula(padded, n, stage, "fp32")
        got = res.memory
        assert (got["params"], got["grads"], got["optimizer"]) == (want["params"], want["grads"],
                                                                  want["optimizer"]), (stage, n, got, want)
        unpadded = zero_memory.model_state_bytes_formula(psi, n, stage, "fp32")["total"]
        assert abs(sum(got[k] for k in ("params", "grads", "optimizer")) - unpadded) <= 16 * (padded - psi)
        # bytes sent per step, from the comm log, next to the formula
        assert res.bytes_sent == [zero_memory.bytes_sent_per_step(padded, n, stage, "fp32")] * len(res.bytes_sent)


def test_stage3_sends_one_and_a_half_times_ddp(four_ranks):
    ddp, z3 = four_ranks[0][0].bytes_sent[0], four_ranks[3][0].bytes_sent[0]
    assert z3 == pytest.approx(1.5 * ddp)
    assert four_ranks[1][0].bytes_sent == four_ranks[2][0].bytes_sent == four_ranks[0][0].bytes_sent


def test_memory_falls_stage_by_stage(four_ranks):
    totals = [sum(four_ranks[s][0].memory[k] for k in ("params", "grads", "optimizer")) for s in zero.STAGES]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_uneven_units_are_padded_and_still_exact():
    # MLP 5 -> 7 -> 3: units of 42 and 24 parameters on 4 ranks: 2 and 0 padding elements.
    recipe = mlp_recipe(steps=3, batch_size=12, sizes=(5, 7, 3), optimizer="adam")
    per_layer = lambda model: [*model.layers, model]  # noqa: E731
    results = launch(measure_stages, 4, recipe, (2, 3), units=per_layer, **NO_PEAK, quiet=True)
    reference = train_reference(recipe)
    for stage in (2, 3):
        compare(reference, [r[stage] for r in results]).assert_ok()
        assert results[0][stage].padded_numel - results[0][stage].numel == 2


def test_mixed_precision_hook_bf16_compute_fp32_master():
    recipe = gpt_recipe(steps=3)
    results = launch(measure_stages, 2, recipe, (0, 1, 3), param_dtype=torch.bfloat16, **NO_PEAK, quiet=True)
    ddp = results[0][0]
    for stage in (1, 3):  # sharding stays exact under BF16 compute too
        compare(RunResult(ddp.losses, ddp.params), [r[stage] for r in results], atol=0, rtol=0).assert_ok()
    # BF16 compute against FP32 single-device training: the losses agree to BF16 precision.
    reference = train_reference(recipe).losses
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(ddp.losses, reference))
    psi = ddp.padded_numel
    stage1 = results[0][1].memory
    # BF16 parameters (2Ψ) and gradients (2Ψ, plus the FP32 upcast of my shard 4Ψ/N); FP32 master, m, v: 12Ψ/N
    assert (stage1["params"], stage1["grads"], stage1["optimizer"]) == (2 * psi, 2 * psi + 4 * psi // 2,
                                                                        12 * psi // 2)


def test_prefetch_off_gives_the_same_result_and_bytes(four_ranks):
    results = four_ranks["3, no prefetch"]
    compare(RunResult(four_ranks[3][0].losses, four_ranks[3][0].params), results, atol=0, rtol=0).assert_ok()
    assert results[0].bytes_sent == four_ranks[3][0].bytes_sent


def _accumulating_stages(rank, world_size, recipe):
    per_layer = lambda model: [*model.layers, model]  # noqa: E731  (the root unit alone accumulates in place)
    return {s: measured_train(rank, world_size, recipe, stage=s, accum_steps=2, units=per_layer, **NO_PEAK)
            for s in (1, 2, 3)}


def test_gradient_accumulation_matches_single_device_and_stage2_reduces_every_micro_batch():
    recipe = mlp_recipe(steps=2, batch_size=8, sizes=(5, 7, 3), optimizer="adam")
    results = launch(_accumulating_stages, 2, recipe, quiet=True)
    reference = train_reference(recipe)            # two partial sums per step: float32 rounding, the default tolerance
    for stage in (1, 2, 3):
        compare(reference, [r[stage] for r in results]).assert_ok()
    # stage 1 reduce-scatters once a step whatever the micro-batches; stage 2 once per micro-batch (+ one all-gather)
    assert results[0][2].bytes_sent[-1] > results[0][1].bytes_sent[-1]


def test_bad_input_raises_before_launch():
    with pytest.raises(ValueError, match="stage"):
        zero.validate(RECIPE, world_size=4, stage=4)
    with pytest.raises(ValueError, match="split evenly"):
        zero.validate(RECIPE, world_size=3, stage=1)
    with pytest.raises(ValueError, match="micro-batches"):
        zero.validate(RECIPE, world_size=4, stage=2, accum_steps=3)
    with pytest.raises(ValueError, match="accum_steps"):
        zero.validate(RECIPE, world_size=4, stage=2, accum_steps=0)
    with pytest.raises(ValueError, match="stage"):
        ZeRO(torch.nn.Linear(2, 2), torch.optim.Adam, stage=5)


# --- the bytes on the wire: minipar's rings send the paper's bytes; gloo's reduce-scatter twice that -------

def _ring_and_gloo(rank, world_size, recipe):
    with comm.ring_algorithms():                               # the one switch: minipar's send/recv rings
        ring = measured_train(rank, world_size, recipe, stage=3, **NO_PEAK)
    return {"ring": ring, "gloo": measured_train(rank, world_size, recipe, stage=3, **NO_PEAK)}


@pytest.mark.skipif(not wire.available(), reason="no /proc/self/io")
def test_ring_collectives_send_the_formula_observed_and_gloo_more():
    """ZeRO-3 on 4 ranks: on minipar's send/recv rings the sockets carry the formula 3bΨ(N-1)/N plus
    framing (measured +1.4 %) and the check that the ranks agree on each unit collective (two int64 all-reduced
    before each, :class:`minipar.data.units.UnitOrder`: +1.0-1.3 % on this small model), < 3.5 % in all; on
    gloo's collectives, whose reduce-scatter all-reduces, (1+1+2)/3 of it (measured 1.37x, 1.38x with the
    check). Both train like one device; the log's model is the same for both (it cannot tell)."""
    recipe = gpt_recipe(steps=2, batch_size=8, seq_len=16, optimizer="adam")
    results = launch(_ring_and_gloo, 4, recipe, quiet=True)
    reference = train_reference(recipe)
    for c in ("ring", "gloo"):
        compare(reference, [r[c] for r in results]).assert_ok()
    for r in results:
        ring, gloo = r["ring"], r["gloo"]
        formula = zero_memory.bytes_sent_per_step(ring.padded_numel, 4, 3, "fp32")
        assert ring.bytes_sent == gloo.bytes_sent == [formula] * 2
        for step in range(2):
            assert formula <= ring.bytes_observed[step] <= 1.035 * formula, ring.bytes_observed
            assert 1.30 * formula <= gloo.bytes_observed[step] <= 1.42 * formula, gloo.bytes_observed


def test_a_collectives_flag_is_refused_before_launch_pointing_to_the_switch():
    with pytest.raises(ValueError, match="ring_algorithms"):
        zero.validate(RECIPE, world_size=4, stage=3, collectives="ring")


# --- 16-bit gradients: divided by N before they are summed, as DDP does ------------------------------------

def _reduce_big_fp16_grads(rank, world_size, collectives):
    from minipar.data.flat_unit import FlatUnit
    layer = torch.nn.Linear(4, 4)
    params = list(layer.parameters())
    from minipar import comm
    unit = FlatUnit(["weight", "bias"], params, None, 2, torch.float16)
    for p in params:                           # 40000 on every rank: the sum, 160000, is beyond FP16 (65504)
        p.grad = torch.full_like(p, 40000.0)
    with comm.ring_algorithms("reduce_scatter") if collectives == "ring" else contextlib.nullcontext():
        unit.reduce_grads_now()
    return unit.master.grad.clone()


@pytest.mark.parametrize("collectives", ["gloo", "ring"])
def test_fp16_gradients_are_averaged_without_overflow(collectives):
    """Summing 16-bit gradients first would overflow (4 x 40000 > 65504, inf); dividing first gives the mean
    exactly (40000/4 = 10000 is exact in FP16)."""
    grads = launch(_reduce_big_fp16_grads, 4, collectives, quiet=True)
    for g in grads:
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        assert torch.equal(g, torch.full_like(g, 40000.0)), g


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_zero3_mixed_precision_trains_like_single_device_mixed_precision(dtype, one_thread):
    """ZeRO-3 with 16-bit compute copies (gathered and freed per unit) and FP32 master shards, on 2 ranks,
    against one device's mixed precision (FP16 with the loss scaler; BF16 without). SGD and the tolerances
    of tests/test_mixed_precision_parallel.py (1e-3 FP16, 5e-3 BF16): the ranks' 16-bit gradients are summed
    in another order and rounded on the way. The reference on one thread (conftest's one_thread), as each
    rank: two threads on a busy 2-core machine mostly spin."""
    from minipar.precision.mixed import train_mixed, zero_parallel_train
    recipe = gpt_recipe(steps=3, optimizer="sgd")
    reference, _ = train_mixed(recipe, dtype)
    results = launch(zero_parallel_train, 2, recipe, dtype, stage=3, quiet=True)
    tol = {torch.float16: 1e-3, torch.bfloat16: 5e-3}[dtype]
    compare(reference, results, atol=tol, rtol=tol).assert_ok()
    assert results[0].state_bytes["params"] < sum(p.numel() for p in recipe.model().parameters()) * 2

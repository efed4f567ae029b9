"""Mixed precision against FP32 training of the same recipe.

* FP32 through the same machinery (master copy = compute copy) is bit-exact: the bookkeeping itself adds
  no error.
* FP16 with dynamic loss scaling and BF16 without scaling train the tiny GPT to a loss within a stated
  tolerance of FP32's at every step. Not exact, because every forward and backward rounds activations,
  weights and gradients to 16 bits (relative rounding error 2^-11 for FP16, 2^-8 for BF16) and the
  trajectories drift apart a little each step. Tolerances: |Δloss| <= 0.03 (FP16), 0.06 (BF16) per step over
  8 Adam steps (measured here: 0.0024 and 0.0044), while the loss itself falls by more than 0.5 — a wrong
  update (grads not unscaled, weights not copied down, a step lost) moves it far more.
* FP16 without scaling flushes most of a nearly fitted model's gradients to zero; with the scale, none.
"""
import pytest
import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.precision.loss_scaler import DynamicLossScaler
from minipar.precision.mixed import (MixedPrecision, fp32_loss, small_gradient_case, train_mixed,
                                     underflow_fraction)

STEPS = 8
LOSS_TOL = {torch.float16: 0.03, torch.bfloat16: 0.06}


@pytest.fixture(scope="module")
def reference():
    recipe = gpt_recipe(steps=STEPS)
    return recipe, train_reference(recipe)


def test_fp32_through_master_weights_is_bit_exact(one_thread):
    recipe = gpt_recipe(steps=3)
    ref = train_reference(recipe)
    got, _ = train_mixed(recipe, torch.float32)
    compare(ref, [got], atol=0, rtol=0).assert_ok()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_trains_like_fp32(reference, dtype):
    recipe, ref = reference
    got, mp = train_mixed(recipe, dtype)
    diffs = [abs(a - b) for a, b in zip(got.losses, ref.losses)]
    assert max(diffs) <= LOSS_TOL[dtype], diffs
    assert ref.losses[0] - ref.losses[-1] > 0.5                 # the run really learns
    assert all(m.dtype == torch.float32 for m in mp.master)      # masters stay FP32 ...
    assert all(p.dtype == dtype for p in mp.model.parameters())  # ... compute copy is 16-bit
    for n, p in mp.model.named_parameters():                     # compute copy = master rounded down
        assert torch.equal(p, got.params[n].to(dtype))
    if dtype == torch.float16:
        assert [h[2] for h in mp.scaler.history] == [True] * STEPS and mp.scaler.loss_scale == 2.0 ** 16
    else:
        assert mp.scaler is None                                 # BF16: no loss scaling


def test_master_grads_are_unscaled_fp32_grads(one_thread):
    recipe = gpt_recipe(steps=1)
    x, y = recipe.batches[0]
    ref_model = recipe.model()
    fp32_loss(ref_model, x, y).backward()
    mp = MixedPrecision(recipe.model(), lambda ps: torch.optim.SGD(ps, lr=0.0), torch.float16)
    mp.backward(fp32_loss(mp.model, x, y))
    grads = mp.copy_grads_up()
    mp.scaler.unscale_(grads)
    for g, p in zip(grads, ref_model.parameters()):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, p.grad, atol=2e-4, rtol=2e-2)   # FP16 gradient rounding


def test_overflow_skips_step_and_backs_off():
    recipe = gpt_recipe(steps=1)
    mp = MixedPrecision(recipe.model(), recipe.optimizer, torch.float16,
                        DynamicLossScaler(init_scale=2.0 ** 40))       # 2^40 · loss overflows FP16
    before = mp.master_params()
    _, stepped = mp.train_step(fp32_loss, *recipe.batches[0])
    assert not stepped and mp.scaler.loss_scale == 2.0 ** 39
    after = mp.master_params()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_fp16_without_scaling_underflows():
    make, x, y = small_gradient_case()
    fp32 = make()
    fp32_loss(fp32, x, y).backward()
    g32 = [p.grad for p in fp32.parameters()]
    assert all(bool((g != 0).all()) for g in g32)
    fractions = {}
    for name, scaler in (("unscaled", None), ("scaled", DynamicLossScaler())):
        mp = MixedPrecision(make(), lambda ps: torch.optim.SGD(ps, lr=0.0), torch.float16, scaler)
        mp.backward(fp32_loss(mp.model, x, y))
        fractions[name] = underflow_fraction([p.grad for p in mp.model.parameters()], g32)
    assert fractions["unscaled"] > 0.3, fractions        # measured: 0.68 of the values flushed to zero
    assert fractions["scaled"] < 0.01, fractions


def test_bad_dtype():
    with pytest.raises(ValueError):
        MixedPrecision(torch.nn.Linear(2, 2), torch.optim.SGD, torch.int8)

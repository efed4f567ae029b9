"""Chapter 10's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import math

import torch

from minipar.precision.formats import BF16
from minipar.precision.formats import FORMATS
from minipar.precision.formats import FP16
from minipar.precision.formats import FP32
from minipar.precision.formats import round_to
from minipar.precision.formats import spacing


def check_three_bit_layouts(exact) -> None:
    """Three bit layouts"""
    assert all(exact)


def check_range_precision_computed_from_layout(finfo) -> None:
    """Range and precision, computed from the layout"""
    assert all((f.max, f.smallest_normal, f.eps) == (finfo[f.name].max, finfo[f.name].tiny, finfo[f.name].eps) for f in FORMATS.values())
    assert FP16.max == 65504 and BF16.smallest_normal == FP32.smallest_normal


def check_flush_only_or_below_2_25(checks) -> None:
    """Range and precision, computed from the layout: flush only at or below 2^-25"""
    assert math.isinf(checks["65520 -> "]) and checks["2^-25 -> "] == 0.0 and checks["2049 -> "] == 2048.0
    assert checks["3e-8 -> "] == 2.0 ** -24 and round_to(2.0 ** -25 * 1.001, FP16) == 2.0 ** -24   # flush only at or below 2^-25
    assert spacing(2048.0, FP16) == 2.0 and spacing(1.0, BF16) == 2.0 ** -7
    assert round_to(1e30, BF16) > 0 and math.isinf(round_to(1e30, FP16))   # BF16 has FP32's range, FP16 does not


def check_overflow_underflow_real_step(flushed) -> None:
    """Overflow and underflow in a real step: the MLP built to sit in the underflow zone loses a large share
    without scaling and almost none at 2^16; the tiny GPT, not built for it, loses almost none even unscaled"""
    assert flushed["FP16, no loss scaling"] > 0.3 and flushed["FP16, loss scale 2^16"] < 0.01
    assert flushed.get("tiny GPT, FP16, no loss scaling", 0.0) < 0.01


def check_overflow_skips_step_and_halves_scale(n_inf, stepped, mp, untouched) -> None:
    """Overflow and underflow in a real step"""
    assert n_inf > 0 and not stepped and mp.scaler.loss_scale == 2.0 ** 29 and untouched


def check_dynamic_loss_scaling_step_by(agree, p_ours, p_torch) -> None:
    """Dynamic loss scaling, step by step"""
    assert all(agree) and torch.equal(p_ours, p_torch)


def check_skipped_first_then_trains(mp) -> None:
    """Dynamic loss scaling, step by step: skipped first, then trains"""
    assert mp.scaler.history[0][1] and not mp.scaler.history[-1][1]


def check_model_us_own_rounding(kept, w, sweep) -> None:
    """Master weights: why small updates vanish without them: model ± u's own rounding"""
    assert bool(kept != w) and all(2 ** 11 <= r16 < 2 ** 12 and 2 ** 8 <= rb < 2 ** 9 for r16, _, rb, _ in sweep.values())
    assert all(abs(r16 - m16) <= 2 and abs(rb - mb) <= 2 for r16, m16, rb, mb in sweep.values())   # model ± u's own rounding


def check_master_weights_why_small_updates(lost) -> None:
    """Master weights: why small updates vanish without them"""
    assert lost["FP32"] < 0.01 < lost["FP16"] < lost["BF16"]


def check_lr_g_g_eps(update, adam_lost, half_lost_fp16) -> None:
    """Master weights: why small updates vanish without them: lr·g/(|g| + eps)"""
    assert torch.allclose(update.abs(), torch.full_like(update, 3e-4), rtol=2e-2)   # lr·g/(|g| + eps)
    assert adam_lost["BF16"] == 1.0 and adam_lost["FP32"] == 0.0 and half_lost_fp16 and 0 < adam_lost["FP16"] < 1


def check_masters_follow_fp32(fp32_final, masters_final: dict, masters_gap: dict, bf16_only_final,
                              first_loss, gains_moved) -> None:
    """Master weights at model level: with FP32 masters FP16 and BF16 follow FP32's loss (loose bound on the
    largest per-step gap; the printed gap is the measurement); BF16 without masters falls behind, by more than
    five times the masters' final gap, and its LayerNorm gains never leave 1.0 (|w|/lr past 2^9); FP32 learns"""
    assert all(g <= 0.03 for g in masters_gap.values()), masters_gap
    masters_off = max(abs(f - fp32_final) for f in masters_final.values())
    assert bf16_only_final - fp32_final > max(0.05, 5 * masters_off), (bf16_only_final, fp32_final, masters_off)
    assert fp32_final < first_loss - 1.0 and gains_moved[0] == 0 < gains_moved[1], gains_moved


def check_bf16_needs_no_scaler(mp, bf16_flushed, zero_at) -> None:
    """BF16's trade: FP32's smallest normal, but it reaches zero sooner (2^-134 against 2^-150)"""
    assert mp.scaler is None and bf16_flushed < 0.01
    assert zero_at == {"FP16": 2.0 ** -25, "BF16": 2.0 ** -134, "FP32": 2.0 ** -150}
    for f in FORMATS.values():                  # torch rounds the threshold to 0 and a hair above it to the subnormal
        assert round_to(zero_at[f.name], f) == 0.0 and round_to(zero_at[f.name] * 1.01, f) == f.smallest_subnormal


def check_what_16_bits_halve_what(per_param, master, during_step) -> None:
    """What 16 bits halve, and what they do not: 16 B after backward, 18 B during step"""
    assert per_param == {"FP32 Adam": 16, "mixed-precision Adam": 16} and master["grads"] == 0
    assert during_step == 18


def check_16_bits_halve_wire_and_activations(act_ratio, wire_ratio, wire, wire_model) -> None:
    """What 16 bits halve, and what they do not"""
    assert 1.8 < act_ratio <= 2 and wire_ratio == 2 and all(wire[dt] == wire_model[dt] for dt in wire)


def check_autocast_dtypes(under_autocast, ln, w) -> None:
    """What 16 bits halve, and what they do not: under autocast the weights and their gradients stay FP32"""
    assert under_autocast["matmul"].dtype == torch.bfloat16 and under_autocast["cross_entropy"].dtype == torch.float32
    assert ln.weight.dtype == w.dtype == ln.weight.grad.dtype == w.grad.dtype == torch.float32


def check_accumulation(exact, matmul, running) -> None:
    """The matmul sums in FP32 (one rounding, within BF16's half gap of the exact sum); the BF16 running sum
    stalls once half its gap exceeds a product (< 1): far below the exact sum"""
    assert abs(matmul - exact) <= exact * 2.0 ** -8 and running == 256 < exact / 2      # 256: the gap is 2 there


def check_table_claims_checked(decades) -> None:
    """Common statements about FP16 and BF16, checked"""
    assert round(FP16.decimal_digits, 1) == 3.3 and round(BF16.decimal_digits, 1) == 2.4 and round(FP32.decimal_digits, 1) == 7.2
    assert BF16.eps / FP32.eps == 65536 and round(decades["FP16"]) == 12 and round(decades["FP32"]) == 83


def check_updates_down_survive(vanished16, update) -> None:
    """Master weights: with Adam at w = 1 in FP16, every update up vanishes and every update down survives
    (the gap above 1.0 is 2^-10, below it 2^-11)"""
    assert bool(vanished16[update > 0].all()) and not bool(vanished16[update < 0].any())


def check_clip_after_unscale(rows, max_norm, scale) -> None:
    """Dynamic loss scaling: clipping before unscale_ sees S times the true norm (5) and clips S times too hard"""
    seen, after = rows["clip, then unscale_"]
    assert math.isclose(seen, 5 * scale, rel_tol=1e-4) and math.isclose(after, max_norm / scale, rel_tol=1e-3)
    seen, after = rows["unscale_, then clip"]
    assert math.isclose(seen, 5.0, rel_tol=1e-4) and math.isclose(after, max_norm, rel_tol=1e-3)


def check_sharded_overflow_needs_all_reduce(ways, init_scale) -> None:
    """With its own flag rank 0 steps and rank 1 skips (the replicas part); with the flag all-reduced both skip"""
    assert ways["own flag"] == [(True, init_scale), (False, init_scale / 2)]
    assert ways["flag all-reduced (MAX)"] == [(False, init_scale / 2)] * 2


def check_fp16_gap_is_the_skip(skipped, before, window, steps: int, after=None) -> None:
    """§6: FP16's larger largest gap comes from the step its scaler skipped on an overflow (the run is then one
    update behind); before that step FP16, with 3 more fraction bits, stays closer to FP32 than BF16 does, both
    at its largest gap and in the mean |gap| over the 20 steps before the skip (``window``); from the skip on
    (``after``) FP16's largest gap is past BF16's; the skip falls in the final-loss column's last 20 of ``steps``"""
    assert skipped, "FP16's scaler skipped no step: §6's sentence about the skipped step no longer holds"
    assert skipped[0] >= steps - 20, f"the skip at step {skipped[0] + 1} is not among the last 20 of {steps}"
    assert before["FP16 + FP32 masters + scaler"] < before["BF16 + FP32 masters, no scaler"], before
    assert window["FP16 + FP32 masters + scaler"] < window["BF16 + FP32 masters, no scaler"], window
    assert after is None or after["FP16 + FP32 masters + scaler"] > after["BF16 + FP32 masters, no scaler"], after

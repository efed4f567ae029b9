"""Chapter 10 checks accept the right answers and reject plausible wrong ones: decoding without
subnormals, with the wrong bias, without inf/NaN; a scaler that does not reset its count on overflow,
grows one step late, or steps on an overflow."""
import math

import pytest

from minipar.course.checks import ExerciseError
from minipar.course.ch10_mixed_precision import checks as ch10


def decode_right(bits, e, m, subnormals=True, bias_offset=-1, specials=True):
    sign = -1.0 if bits >> (e + m) else 1.0
    exp, frac = (bits >> m) & (2 ** e - 1), bits & (2 ** m - 1)
    bias = 2 ** (e - 1) + bias_offset
    if specials and exp == 2 ** e - 1:
        return sign * math.inf if frac == 0 else math.nan
    if subnormals and exp == 0:
        return sign * math.ldexp(frac / 2 ** m, 1 - bias)
    return sign * math.ldexp(1 + frac / 2 ** m, exp - bias)


def decode_no_subnormals(bits, e, m):
    return decode_right(bits, e, m, subnormals=False)


def decode_wrong_bias(bits, e, m):
    return decode_right(bits, e, m, bias_offset=0)


def decode_no_specials(bits, e, m):
    return decode_right(bits, e, m, specials=False)


def decode_stub(bits, e, m):
    raise NotImplementedError()


def update_right(scale, good, overflow, growth, backoff, interval, reset=True, late=False, step_anyway=False):
    if overflow:
        return step_anyway, scale * backoff, 0 if reset else good
    good += 1
    if good == interval + (1 if late else 0):
        return True, scale * growth, 0
    return True, scale, good


def update_no_reset(*a):
    return update_right(*a, reset=False)


def update_grows_late(*a):
    return update_right(*a, late=True)


def update_steps_on_overflow(*a):
    return update_right(*a, step_anyway=True)


def test_decode_right_passes():
    ch10.check_decode(decode_right)


@pytest.mark.parametrize("wrong", [decode_no_subnormals, decode_wrong_bias, decode_no_specials])
def test_decode_wrong_rejected(wrong):
    with pytest.raises(ExerciseError):
        ch10.check_decode(wrong)


def test_decode_stub_not_implemented():
    with pytest.raises(NotImplementedError):
        ch10.check_decode(decode_stub)


def test_scaler_update_right_passes():
    ch10.check_scaler_update(update_right)


@pytest.mark.parametrize("wrong", [update_no_reset, update_grows_late, update_steps_on_overflow])
def test_scaler_update_wrong_rejected(wrong):
    with pytest.raises(ExerciseError):
        ch10.check_scaler_update(wrong)


def test_messages_name_the_mistake():
    with pytest.raises(ExerciseError, match="subnormal"):
        ch10.check_decode(decode_no_subnormals)
    with pytest.raises(ExerciseError, match="bias"):
        ch10.check_decode(decode_wrong_bias)
    with pytest.raises(ExerciseError, match="reset"):
        ch10.check_scaler_update(update_no_reset)


def test_clipping_before_unscale_clips_s_times_too_hard():
    """§4's demo: clip_grad_norm_ on GradScaler's still-scaled gradients sees S x the norm; the claim tells the
    two orders apart (swapped, it fails)."""
    import pytest
    from minipar.course.ch10_mixed_precision import claims
    from minipar.course.ch10_mixed_precision.report import _clipped_norm
    rows = {order: _clipped_norm(order == "unscale_, then clip", 1.0, 2.0 ** 16)
            for order in ("clip, then unscale_", "unscale_, then clip")}
    claims.check_clip_after_unscale(rows, 1.0, 2.0 ** 16)
    swapped = dict(zip(rows, reversed(list(rows.values()))))
    with pytest.raises(AssertionError):
        claims.check_clip_after_unscale(swapped, 1.0, 2.0 ** 16)


def test_sharded_overflow_claim_holds_and_rejects_ranks_that_agree_or_part():
    from minipar.course.ch10_mixed_precision import claims
    from minipar.course.ch10_mixed_precision.sharded_overflow import show_sharded_overflow
    show_sharded_overflow()                                   # the claim holds on the real decisions
    skip, step = (False, 2.0 ** 15), (True, 2.0 ** 16)
    for own, agreed in (([skip, skip], [skip, skip]), ([step, skip], [step, skip])):   # no parting; still parting
        with pytest.raises(AssertionError):
            claims.check_sharded_overflow_needs_all_reduce({"own flag": own, "flag all-reduced (MAX)": agreed},
                                                           2.0 ** 16)


def test_fp16_gap_claim_rejects_a_skip_outside_the_final_window_or_fp16_further_before_it():
    from minipar.course.ch10_mixed_precision import claims
    fp16, bf16 = "FP16 + FP32 masters + scaler", "BF16 + FP32 masters, no scaler"
    closer = {fp16: 1e-4, bf16: 5e-4}
    further = {fp16: 5e-4, bf16: 1e-4}
    claims.check_fp16_gap_is_the_skip([196], closer, closer, 200)                  # §6's run: holds
    for skipped, before, window in (([100], closer, closer), ([196], closer, further)):
        with pytest.raises(AssertionError):
            claims.check_fp16_gap_is_the_skip(skipped, before, window, 200)
    claims.check_fp16_gap_is_the_skip([196], closer, closer, 200, further)          # after the skip FP16 is further
    with pytest.raises(AssertionError):                                               # §6 says its gap passes BF16's
        claims.check_fp16_gap_is_the_skip([196], closer, closer, 200, closer)

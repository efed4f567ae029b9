"""Chapter 15 checks accept the right answers and reject the stub and plausible wrong ones: Young/Daly without
the factor 2, without the square root, with M divided; a fingerprint that is a float sum, or the sum of the
absolute values, or random; a live-replica average that divides by the configured replicas, averages a dead
replica's gradient in, or does not divide."""
import math

import pytest
import torch

from minipar.course.checks import ExerciseError
from minipar.course.ch15_when_a_device_dies import checks as ch15
from minipar.debug.sdc import fingerprint


def stub(*args):
    raise NotImplementedError()


def test_young_daly_right_stub_and_wrong():
    ch15.check_young_daly(lambda c, m: math.sqrt(2 * c * m))
    with pytest.raises(NotImplementedError):
        ch15.check_young_daly(stub)
    for wrong, mistake in [(lambda c, m: math.sqrt(c * m), "the factor 2"),
                           (lambda c, m: 2 * c * m, "the square root"),
                           (lambda c, m: math.sqrt(c * m / 2), "τ/2 on average"),
                           (lambda c, m: math.sqrt(2 * m / c), "grows with both")]:
        with pytest.raises(ExerciseError, match=mistake):
            ch15.check_young_daly(wrong)


def test_fingerprint_right_stub_and_wrong():
    ch15.check_fingerprint(lambda t: fingerprint([t]))
    with pytest.raises(NotImplementedError):
        ch15.check_fingerprint(stub)
    for wrong, mistake in [(lambda t: float(t.double().sum()), "floating-point sum"),
                           (lambda t: float(t.abs().sum()), "floating-point sum"),
                           (lambda t: torch.rand(1), "a function of the bits")]:
        with pytest.raises(ExerciseError, match=mistake):
            ch15.check_fingerprint(wrong)


def test_average_live_right_stub_and_wrong():
    ch15.check_average_live(lambda grads, live: sum(grads[r] for r in live) / len(live))
    with pytest.raises(NotImplementedError):
        ch15.check_average_live(stub)
    for wrong, mistake in [(lambda grads, live: sum(grads[r] for r in live) / len(grads), "configured replicas"),
                           (lambda grads, live: sum(grads) / len(grads), "never voted on"),
                           (lambda grads, live: sum(grads[r] for r in live), "a sum, not a mean"),
                           (lambda grads, live: grads[live[0]], "the mean over the live")]:
        with pytest.raises(ExerciseError, match=mistake):
            ch15.check_average_live(wrong)

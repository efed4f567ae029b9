"""§6b's spike: one batch of outliers makes the loss jump without a NaN; the norm guard skips exactly that step."""
import pytest

from minipar.course.ch13_when_it_goes_wrong import claims
from minipar.course.ch13_when_it_goes_wrong.spikes import spiked_run


def test_the_guard_skips_the_outlier_batch_and_only_it():
    plain, guarded = spiked_run(None, bad_step=12), spiked_run(5.0, bad_step=12)
    claims.check_spike_skipped(plain, guarded, 12)
    with pytest.raises(AssertionError):               # an unguarded run passed as the guarded one is caught
        claims.check_spike_skipped(plain, plain, 12)

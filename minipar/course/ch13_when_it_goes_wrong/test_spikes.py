"""§7's spike: one batch of outliers makes the loss jump without a NaN; the norm guard skips exactly that step,
and clipping at 1.0 takes it but bounds it."""
import pytest

from minipar.course.ch13_when_it_goes_wrong import claims
from minipar.course.ch13_when_it_goes_wrong.spikes import spiked_run


@pytest.fixture(scope="module")
def single():
    """The single-spike runs, (plain, clipped at 1.0, guarded at 5.0): both tests read them, trained once."""
    return spiked_run(None, bad_step=12), spiked_run(None, bad_step=12, clip=1.0), spiked_run(5.0, bad_step=12)


def test_the_guard_skips_the_outlier_batch_and_clipping_bounds_it(single):
    plain, clipped, guarded = single
    claims.check_spike_skipped(plain, guarded, 12)
    claims.check_clipping_bounds_the_step(clipped, 12, 1.0)
    with pytest.raises(AssertionError):               # an unguarded run passed as the guarded one is caught
        claims.check_spike_skipped(plain, plain, 12)
    with pytest.raises(AssertionError):               # the unclipped run's jump is caught
        claims.check_clipping_bounds_the_step(plain, 12, 1.0)


def test_on_a_corrupt_shard_the_guard_beats_clipping(single):
    runs = [spiked_run(guard, bad_step=12, clip=clip, bad_steps=6, flipped=True)
            for guard, clip in ((None, None), (None, 1.0), (5.0, None))]
    claims.check_skip_guard_beats_clipping_on_a_corrupt_shard(*runs, 12, 6)
    plain, clipped, _ = runs
    with pytest.raises(AssertionError):               # clipping passed as the guard is caught
        claims.check_skip_guard_beats_clipping_on_a_corrupt_shard(plain, clipped, clipped, 12, 6)
    with pytest.raises(AssertionError):               # on the first spike the guard has no such case
        claims.check_skip_guard_beats_clipping_on_a_corrupt_shard(*single, 12, 1)

"""The checkpoint interval (minipar.debug.checkpoint_interval): Young's τ* = √(2CM) minimises the first-order
waste, Daly's estimate stays within 2·C/τ* of it, Llama 3's published rate gives a
mean time between interruptions of about 3.1 hours, and an asynchronous save's interval is priced by the
snapshot, bounded below by the write."""
import math

import pytest

from minipar.debug import checkpoint_interval as ci


def test_young_daly_minimises_the_waste():
    c, m = 60.0, 3 * 3600.0
    tau = ci.young_daly_interval(c, m)
    assert tau == pytest.approx(math.sqrt(2 * c * m))                # 1138.4 s: a wrong factor (√(CM)) misses
    waste = ci.wasted_fraction(tau, c, m)
    assert waste == pytest.approx(math.sqrt(2 * c / m))
    for other in (0.5 * tau, 0.9 * tau, 1.1 * tau, 2 * tau):
        assert ci.wasted_fraction(other, c, m) > waste
    assert abs(ci.daly_interval(c, m) / tau - 1) < 2 * c / tau
    assert ci.daly_interval(3 * m, m) == m


def test_llama3_rate_and_what_async_saving_changes():
    m = ci.mtbf_seconds(ci.LLAMA3_405B["interruptions"], ci.LLAMA3_405B["days"])
    assert m / 3600 == pytest.approx(3.09, abs=0.01)
    snapshot, write = 2.0, 120.0
    sync = ci.young_daly_interval(snapshot + write, m)
    asyn = ci.async_interval(snapshot, write, m)
    assert asyn == pytest.approx(ci.young_daly_interval(snapshot, m)) and asyn < sync
    assert ci.async_interval(snapshot, 10 * sync, m) == 10 * sync    # never shorter than the write
    assert ci.wasted_fraction(asyn, snapshot, m, in_flight_seconds=write) < ci.wasted_fraction(sync, snapshot + write, m)
    with pytest.raises(ValueError):
        ci.mtbf_seconds(0, 54)

"""Chapter 03's timing helper: refuses bad input before launch; a short run gives both traces, replayable."""
import pytest

from minipar.course.ch03_zero_and_fsdp import timing


def test_measure_refuses_one_step_before_launch():
    with pytest.raises(ValueError, match="at least 2"):
        timing.measure(2, steps=1)


def test_prefetch_is_issued_earlier_than_without():
    """With prefetch some all-gathers are async (issued before they are needed); without, none is."""
    from minipar.plan.cluster import dgx_a100
    from minipar.replay import replay
    from minipar.trace import Comm
    m = timing.measure(2, steps=2)
    asyncs = {name: sum(c.async_ for c in t.ranks[0].comms() if c.op == "all_gather" and isinstance(c, Comm))
              for name, t in m["traces"].items()}
    assert asyncs["prefetch"] > 0 and asyncs["no prefetch"] == 0
    for t in m["traces"].values():
        assert replay(t, dgx_a100(1), source_flops_per_second=m["flops_here"]).step_between("step") > 0

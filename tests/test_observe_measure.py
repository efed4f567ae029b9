"""The measurement wing's measure_steps / calibrate_links on 2 ranks: what they return, and that a step time
is the slowest rank's gap between stamps (no timing asserted beyond being positive: the machine is shared)."""
import math
import statistics

import pytest
import torch

from minipar.check import gpt_recipe
from minipar.data import ddp
from minipar.launcher import launch
from minipar.observe import measure
from minipar.machine.fidelity import OpLinks, ring_terms
from minipar.machine.trace import Mark


def test_measure_steps_times_each_step_on_its_slowest_rank():
    steps = measure.measure_steps(ddp.parallel_train, 2, gpt_recipe(steps=3, batch_size=4), meta={"what": "ddp"})
    assert len(steps.seconds) == 2 and all(s > 0 for s in steps.seconds)          # 3 optimizer steps: 2 gaps
    assert steps.fastest == min(steps.seconds) and steps.trace.meta == {"what": "ddp"}
    assert steps.trace.world_size == 2 and len(steps.results) == 2
    for rank in steps.trace.ranks:                                  # every optimizer step marked in the trace
        assert sum(isinstance(e, Mark) and e.label == "step" for e in rank.events) == 3
        assert any(c.op == "all_reduce" for c in rank.comms())
    assert measure.step_cpu_seconds(steps.trace) > 0
    with pytest.raises(ValueError, match="at least 2 steps"):
        measure.measure_steps(ddp.parallel_train, 2, gpt_recipe(steps=1))


def test_gather_steps_takes_the_slowest_rank_of_each_step():
    a, b = measure.RankSteps(), measure.RankSteps()
    a.stamps, b.stamps = [0.0, 1.0, 3.0, 4.0], [0.5, 1.0, 2.0, 5.0]
    steps = measure.gather_steps([a, b])
    assert steps.seconds == [1.0, 2.0, 3.0] and steps.fastest == 1.0 and steps.trace is None
    assert measure.gather_steps([a, b], skip=2).seconds == [3.0]
    b.stamps = [0.0, 1.0]
    with pytest.raises(ValueError, match="different number of steps"):
        measure.gather_steps([a, b])


def _ticks(rank, world_size):
    with measure.timed_steps(rank) as run:
        for _ in range(3):
            torch.ones(8).sum()
            run.tick()
    return run


def test_timed_steps_ticks_inside_a_launch():
    steps = measure.gather_steps(launch(_ticks, 2, quiet=True))
    assert len(steps.seconds) == 2 and [m.label for m in steps.trace.ranks[1].events if isinstance(m, Mark)] == ["step"] * 3


def test_calibrate_links_times_every_op_and_the_pingpong():
    links = measure.calibrate_links(2, sizes=(4, 2 ** 16), repeats=3, p2p_sizes=(1024, 2 ** 16))
    assert len(links.calls) == 2 and set(links.calls[0]) == set(measure.LINK_OPS)
    assert all(len(v) == 3 for r in links.calls for op in r.values() for v in op.values())
    assert set(links.p2p) == {1024, 2 ** 16} and all(len(v) == 2 for v in links.p2p.values())   # warm-up left out
    fastest, mean = links.seconds("all_reduce", min), links.seconds("all_reduce")
    assert all(0 < fastest[s] <= mean[s] for s in (4, 2 ** 16))
    assert mean[4] == pytest.approx(statistics.fmean(statistics.fmean(r["all_reduce"][4]) for r in links.calls))
    fitted = links.fitted()
    assert fitted is None or (isinstance(fitted, OpLinks) and fitted.p2p is not None)


def test_the_fits_give_back_the_links_times_were_made_from():
    alpha, beta = 2e-4, 6e8
    seconds = {op: {s: ring_terms(op, 4)[0] * alpha + ring_terms(op, 4)[1] * s / beta for s in (4, 2 ** 16, 2 ** 20)}
               for op in measure.LINK_OPS}
    links = measure.fit_links(seconds, 4, p2p=(1e9, 1e-5))
    for op in measure.LINK_OPS:
        assert links.ops[op] == pytest.approx((beta, alpha), rel=1e-9)
    assert links.p2p == (1e9, 1e-5) and measure.fit_links({"all_reduce": {4: 1.0}}, 4) is None
    assert measure.fit_p2p({s: 1e-5 + s / 2e9 for s in (1024, 2 ** 20)}) == pytest.approx((2e9, 1e-5))
    assert measure.fit_p2p({1024: 2e-5, 2 ** 20: 1e-5}) == (math.inf, pytest.approx(2e-5, rel=1e-2))

"""Chapter 05's TP timing (timing.py): one step cut out of a trace, the placements, and a real TP trace's
replayed communication equal to the α-β sum of its collectives on the link the placement puts them on."""
import math

import pytest

from minipar.check import compare, gpt_recipe, train_reference
from minipar.course.ch05_tensor_parallelism import timing
from minipar.observe.cluster import comm_seconds
from minipar.observe.replay import device_scale
from minipar.observe.trace import Comm, Compute, Mark, RankTrace, Trace, Wait


def _recipe(steps=2):
    return gpt_recipe(steps=steps, batch_size=2, seq_len=8, n_layer=1, n_embd=16, n_head=4, vocab_size=16)


def test_one_step_keeps_the_events_between_the_last_two_marks():
    events = [Compute(9.0), Mark("step"), Compute(1.0), Comm("all_reduce", (0, 1), 8), Mark("step"),
              Compute(2.0), Comm("all_reduce", (0, 1), 16), Compute(3.0), Mark("step"), Comm("all_gather", (0, 1), 4)]
    step = timing.one_step(Trace([RankTrace(0, events), RankTrace(1, list(events))]))
    assert [e.seconds_cpu if isinstance(e, Compute) else e.bytes for e in step.ranks[0].events] == [2.0, 16, 3.0]
    with pytest.raises(ValueError, match="fewer than two"):
        timing.one_step(Trace([RankTrace(0, events[:3])]))
    with pytest.raises(ValueError, match="blocking"):
        timing.one_step(Trace([RankTrace(0, [Mark("step"), Comm("send", (0, 1), 4, True), Wait(1), Mark("step")])]))


def test_placements_put_the_ring_inside_one_node_or_across_two():
    for t in (2, 4, 8):
        inside, across = (timing.placements(t, 1e-3, 1e9)[k] for k in ("inside", "across"))
        assert len({r // inside.devices_per_node for r in range(t)}) == 1
        assert len({r // across.devices_per_node for r in range(t)}) == 2
    assert timing.placements(16, 1e-3, 1e9)["inside"] is None


def test_traced_tp_refuses_before_launch():
    with pytest.raises(ValueError, match="at least 2 steps"):
        timing.traced_tp(_recipe(steps=1), 2)
    with pytest.raises(ValueError):
        timing.traced_tp(_recipe(), 3)                       # 4 heads do not split 3 ways


def test_replayed_tp_comm_is_the_alpha_beta_sum_of_the_steps_all_reduces():
    measured, traced, results = timing.traced_tp(_recipe(), 2)
    assert measured > 0 and compare(train_reference(_recipe()), results).matches   # TP trains as one device
    step = timing.one_step(traced)
    calls = [e for e in step.ranks[0].events if isinstance(e, Comm)]
    assert calls and {c.op for c in calls} <= {"all_reduce"}
    table = timing.tp_table(step, 2, alpha=1e-4, beta=1e9, flops_here=1e11)
    for where in ("inside", "across"):
        cluster = timing.placements(2, 1e-4, 1e9)[where]
        expected = sum(comm_seconds(c.op, c.ranks, c.bytes, cluster) for c in calls)
        assert math.isclose(table[where]["comm"], expected, rel_tol=1e-9)
        cpu = max(r.compute_cpu_seconds for r in step.ranks)
        assert math.isclose(table[where]["compute"], cpu * device_scale(cluster, 1e11), rel_tol=1e-9)
    assert table["across"]["comm"] > table["inside"]["comm"] and table["inside"]["ratio"] > 1

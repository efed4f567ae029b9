"""The what-if at real size: a layout's program at GPT-3's size played by the replay engine on a carded cluster
agrees with the planner's closed form (the same operators, links and schedule: one model of time)."""
import pytest

from minipar.machine.cluster import a100_cluster, this_machine
from minipar.observe.opcount import kernel_count
from minipar.machine.trace import Comm, Compute
from minipar.plan import GPT3_175B, Layout
from minipar.plan.whatif import layout_trace, planner_and_replay, replay_layout

LAYOUTS = [Layout(tp=8, pp=2, sp=True, recompute="selective", micro_batches=4),
           Layout(dp=2, tp=4, pp=2, recompute="full", micro_batches=4, schedule="gpipe"),
           Layout(dp=4, tp=2, micro_batches=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_planner_and_replay_agree_within_5_percent_at_gpt3_size(layout):
    got = planner_and_replay(GPT3_175B, layout, a100_cluster(2))
    assert abs(got["ratio"] - 1) <= 0.05, got


def test_the_trace_issues_megatrons_collectives():
    layout = Layout(tp=2, pp=2, sp=True, micro_batches=2)
    trace = layout_trace(GPT3_175B, layout)
    ops = [e.op for e in trace.ranks[0].events if isinstance(e, Comm)]
    layers = GPT3_175B.layers // 2
    # per layer and micro-batch: SP forward 2 all-gathers + 2 reduce-scatters, backward 4 + 2
    assert ops.count("all_gather") == 2 * layers * 6 and ops.count("reduce_scatter") == 2 * layers * 4
    assert ops.count("send") == 2 and ops.count("recv") == 2            # stage 0: activations out, gradients in
    assert all(e.ops for e in trace.ranks[0].events if isinstance(e, Compute))
    assert kernel_count([r for e in trace.ranks[0].events if isinstance(e, Compute) for r in e.ops]) > 1000


def test_bad_what_ifs_are_refused():
    with pytest.raises(ValueError, match="not ZeRO"):
        layout_trace(GPT3_175B, Layout(dp=2, zero=1))
    with pytest.raises(ValueError, match="device card"):
        replay_layout(GPT3_175B, Layout(tp=2), this_machine(1e-4, 1e9, 1e10))

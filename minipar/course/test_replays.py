"""The course's reading of a replay (replays.py): one step read alone; the what-if scales messages only."""
import pytest

from minipar.course import replays
from minipar.machine.replay import ReplayResult, Span
from minipar.machine.trace import Comm, Compute, RankTrace, Trace


def test_exposed_and_hidden_are_read_in_the_last_step_alone():
    spans = [Span(0, "compute", 0, 1, 0), Span(0, "all_reduce", 1, 3, 1),        # step 1: exposed 2
             Span(0, "compute", 3, 5, 3), Span(0, "all_reduce", 4, 5, 4),        # step 2: hidden 1
             Span(0, "all_gather", 5, 6, 6)]                                     # after: a final gather
    result = ReplayResult([spans], [6.0], marks=[[("step", 3.0), ("step", 5.0)]])
    assert replays.exposed_per_step(result) == 0 and replays.hidden_share(result) == 1.0   # whole run: 3, 1/4
    assert [(s.start, s.end) for s in replays.last_step(result).timelines[0]] == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="fewer than two"):
        replays.last_step(ReplayResult([spans], [6.0], marks=[[("step", 3.0)]]))


def test_scaled_multiplies_messages_only():
    trace = Trace([RankTrace(0, [Compute(1.0, 1.0), Comm("all_reduce", (0, 1), 100)])])
    out = replays.scaled(trace, 3.0)
    assert out.ranks[0].events[1].bytes == 300 and out.ranks[0].events[0].seconds_cpu == 1.0
    assert trace.ranks[0].events[1].bytes == 100                     # the measured trace is left as it was


def test_scaled_grows_counted_operators_but_not_their_kernels():
    rows = [{"name": "aten.mm", "kind": "gemm", "count": 2, "flops": 10.0, "bytes": 4.0, "kernels": 1}]
    trace = Trace([RankTrace(0, [Compute(1.0, ops=rows), Compute(1.0, ops=rows), Comm("all_reduce", (0, 1), 100)])])
    out = replays.scaled(trace, 2.0, ops_factor=5.0, op_bytes_factor=3.0).ranks[0].events
    assert out[0].ops == [dict(rows[0], flops=50.0, bytes=12.0)] and out[0].ops is out[1].ops   # still shared
    assert out[2].bytes == 200 and rows[0]["flops"] == 10.0                                     # the trace unchanged
    assert replays.scaled(trace, 1.0, ops_factor=5.0).ranks[0].events[0].ops[0]["bytes"] == 20.0   # bytes × 5 too


def test_replays_on_a_card_play_the_counted_traces_and_refuse_without_them():
    from minipar.machine.cluster import a100_cluster
    from minipar.machine.trace import Mark
    floor = a100_cluster(1).device.launch_floor
    rows = [{"name": "k", "kind": "memory", "count": 4, "flops": 0, "bytes": 0}]          # 4 kernels: 4 floors
    counted = Trace([RankTrace(r, [Mark("step"), Compute(9.0, ops=rows), Mark("step")]) for r in (0, 1)])
    timed = Trace([RankTrace(r, [Mark("step"), Compute(9.0, 1.0), Mark("step")]) for r in (0, 1)])
    played = replays.replays({"traces": {"x": timed}, "counted": {"x": counted}}, {"dgx": a100_cluster(1)})
    assert played["dgx"]["x"].step_between("step") == pytest.approx(4 * floor)
    with pytest.raises(ValueError, match="counted"):
        replays.replays({"traces": {"x": timed}}, {"dgx": a100_cluster(1)})

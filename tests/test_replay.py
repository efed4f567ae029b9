"""The replay engine on hand-made traces, against timelines computed by hand (no processes)."""
import pytest

from minipar.machine.cluster import (IB_NDR, NVLINK3, NVLINK4, PCIE3, Cluster, a100_cluster, comm_seconds, gpu_cluster,
                                     h100_cluster, this_machine)
from minipar.machine.device import H100_SXM, TITAN_RTX
from minipar.machine.replay import Deadlock, WaitedCall, replay
from minipar.machine.trace import Comm, Compute, Mark, RankTrace, Trace, Wait
from minipar.pipeline.schedule_trace import from_schedule

approx = lambda x: pytest.approx(x, abs=1e-12)  # noqa: E731


def cluster(alpha=0.0, bw=1000.0, devices_per_node=2, nodes=1, inter_bw=None, inter_alpha=None):
    """Peak 1 FLOP/s: compute seconds as written (scale 1)."""
    return Cluster(devices_per_node, nodes, 1e9, 1.0, bw, inter_bw or bw, alpha,
                   alpha if inter_alpha is None else inter_alpha)


def rank_trace(rank, *events):
    """Events given as Compute / Comm / ("wait", comm index); fills each Comm's waited_at."""
    out = []
    for e in events:
        if isinstance(e, tuple):
            out.append(Wait(e[1]))
            out[e[1]].waited_at = len(out) - 1
        else:
            out.append(e)
    return RankTrace(rank, out)


def C(seconds):
    return Compute(seconds, seconds)


def spans(result, rank):
    return [(s.kind, round(s.start, 9), round(s.end, 9)) for s in result.timelines[rank]]


def test_blocking_all_reduce_between_unequal_computes():
    # all-reduce of S = 1000 B on 2 ranks: 2(n-1)·α + 2(n-1)/n·S/β = 2·0.1 + 1000/1000 = 1.2 s
    ar = lambda: Comm("all_reduce", (0, 1), 1000)  # noqa: E731
    trace = Trace([rank_trace(0, C(1.0), ar(), C(1.0)), rank_trace(1, C(3.0), ar(), C(1.0))])
    res = replay(trace, cluster(alpha=0.1), compute_scale=1.0)
    # it starts when the slower rank issues it (t = 3), ends at 4.2; rank 0 idles from 1 to 3
    assert spans(res, 0) == [("compute", 0, 1), ("all_reduce", 3, 4.2), ("compute", 4.2, 5.2)]
    assert spans(res, 1) == [("compute", 0, 3), ("all_reduce", 3, 4.2), ("compute", 4.2, 5.2)]
    assert res.step_seconds == approx(5.2)
    assert (res.compute(0), res.exposed(0), res.hidden(0), res.idle(0)) == (approx(2), approx(1.2), 0, approx(2))
    assert (res.compute(1), res.exposed(1), res.idle(1)) == (approx(4), approx(1.2), approx(0))


def test_overlapped_buckets_hidden_and_exposed():
    # DDP-like: bucket 1 issued mid-backward (t = 1.5), bucket 2 at the end of backward (t = 2.0), both
    # waited for before the optimizer step (0.3 s). Each bucket: S/β = 800/1000 = 0.8 s. The link carries
    # one at a time: bucket 2 queues until 2.3.
    def ranks(r):
        return rank_trace(r, C(1.5), Comm("all_reduce", (0, 1), 800, async_=True), C(0.5),
                          Comm("all_reduce", (0, 1), 800, async_=True), ("wait", 1), ("wait", 3), C(0.3))
    res = replay(Trace([ranks(0), ranks(1)]), cluster(), compute_scale=1.0)
    assert spans(res, 0) == [("compute", 0, 1.5), ("compute", 1.5, 2.0), ("all_reduce", 1.5, 2.3),
                             ("all_reduce", 2.3, 3.1), ("compute", 3.1, 3.4)]
    assert res.step_seconds == approx(3.4)           # blocking would be 2.3 + 1.6 = 3.9
    assert res.hidden(0) == approx(0.5)              # bucket 1 under the last 0.5 s of backward
    assert res.exposed(0) == approx(1.1)             # its last 0.3 s and all of bucket 2
    assert res.idle(0) == approx(0.0)
    blocking = Trace([rank_trace(r, C(1.5), Comm("all_reduce", (0, 1), 800), C(0.5),
                                 Comm("all_reduce", (0, 1), 800), C(0.3)) for r in (0, 1)])
    assert replay(blocking, cluster(), compute_scale=1.0).step_seconds == approx(3.9)


def test_never_waited_async_is_waited_at_the_end():
    trace = Trace([rank_trace(r, Comm("all_reduce", (0, 1), 1000, async_=True), C(0.25)) for r in (0, 1)])
    res = replay(trace, cluster(), compute_scale=1.0)
    assert res.finish == [approx(1.0), approx(1.0)] and res.hidden(0) == approx(0.25)


def test_two_stage_pipeline_bubble():
    # 1F1B, p = 2, m = 2: F = 1, B = 2, a message α = 0.5 (0 bytes). Stage 0 isends activations (waited at
    # its end), both stages recv blocking; a message starts when both sides posted it (rendezvous).
    msg = lambda op, peer, asy=False: Comm(op, (0, 1), 0, async_=asy)  # noqa: E731
    s0 = rank_trace(0, C(1), msg("send", 1, True), C(1), msg("send", 1, True), msg("recv", 1), C(2),
                    msg("recv", 1), C(2), ("wait", 1), ("wait", 3))
    s1 = rank_trace(1, msg("recv", 0), C(1), C(2), msg("send", 0), msg("recv", 0), C(1), C(2), msg("send", 0))
    res = replay(Trace([s0, s1]), cluster(alpha=0.5), compute_scale=1.0)
    assert spans(res, 0) == [("compute", 0, 1), ("send", 1, 1.5), ("compute", 1, 2), ("recv", 4.5, 5),
                             ("send", 5, 5.5), ("compute", 5, 7), ("recv", 8.5, 9), ("compute", 9, 11)]
    assert spans(res, 1) == [("recv", 1, 1.5), ("compute", 1.5, 2.5), ("compute", 2.5, 4.5), ("send", 4.5, 5),
                             ("recv", 5, 5.5), ("compute", 5.5, 6.5), ("compute", 6.5, 8.5), ("send", 8.5, 9)]
    assert res.step_seconds == approx(11) and res.finish[1] == approx(9)
    # stage 0 waits 2 -> 4.5 and 7 -> 8.5 for gradients: the bubble; activations hide under its compute
    assert (res.compute(0), res.hidden(0), res.exposed(0), res.idle(0)) == (6, approx(1), approx(1), approx(4))
    assert (res.compute(1), res.hidden(1), res.exposed(1), res.idle(1)) == (6, 0, approx(2), approx(3))


def test_deadlock_names_who_waits_for_whom():
    never = Trace([rank_trace(0, C(1), Comm("all_reduce", (0, 1), 8)), rank_trace(1, C(1))])
    with pytest.raises(Deadlock, match=r"rank 0 waits for all_reduce #0 on ranks \(0, 1\): rank 1 never issues"):
        replay(never, cluster(), compute_scale=1.0)
    both_recv = Trace([rank_trace(0, Comm("recv", (0, 1), 4), Comm("send", (0, 1), 4)),
                       rank_trace(1, Comm("recv", (0, 1), 4), Comm("send", (0, 1), 4))])
    with pytest.raises(Deadlock) as err:
        replay(both_recv, cluster(), compute_scale=1.0)
    assert "rank 0 waits for message #0 from rank 1 to rank 0: rank 1 waits for message #0 from rank 0 to " \
           "rank 1" in str(err.value)
    assert err.value.waits == {0: ("message #0 from rank 1 to rank 0", [1]),
                               1: ("message #0 from rank 0 to rank 1", [0])}
    assert err.value.calls == {0: WaitedCall("p2p", (1, 0), 0, None), 1: WaitedCall("p2p", (0, 1), 0, None)}


def test_a_deadlock_carries_the_waited_call_as_data():
    """A caller reads the call a rank waits for (its tag included) from ``Deadlock.calls``, not from the
    message: a tag with spaces in it, as an action's name may have, survives."""
    tagged = Trace([rank_trace(0, Comm("recv", (0, 1), 4, tag="F 0 tag 3"), Comm("send", (0, 1), 4)),
                    rank_trace(1, Comm("recv", (0, 1), 4), Comm("send", (0, 1), 4, tag="F 0 tag 3"))])
    with pytest.raises(Deadlock) as err:
        replay(tagged, cluster(), compute_scale=1.0)
    assert err.value.calls[0] == WaitedCall("p2p", (1, 0), 0, "F 0 tag 3")
    assert err.value.calls[1] == WaitedCall("p2p", (0, 1), 0, None)


def test_mismatched_order_is_a_deadlock():
    ar, ag = Comm("all_reduce", (0, 1), 8), Comm("all_gather", (0, 1), 8)
    trace = Trace([rank_trace(0, ar, ag), rank_trace(1, Comm("all_gather", (0, 1), 8), Comm("all_reduce", (0, 1), 8))])
    with pytest.raises(Deadlock, match="mismatched calls: all_reduce #0 on ranks \\(0, 1\\) — rank 0 issued "
                                       "all_reduce, rank 1 issued all_gather"):
        replay(trace, cluster(), compute_scale=1.0)


def test_group_crossing_nodes_takes_the_inter_node_link():
    c = cluster(alpha=0.0, bw=1000.0, devices_per_node=2, nodes=2, inter_bw=100.0, inter_alpha=1.0)
    assert comm_seconds("send", (0, 1), 100, c) == approx(0.1)            # inside node 0
    assert comm_seconds("send", (1, 2), 100, c) == approx(1.0 + 1.0)      # node 0 -> node 1: α + S/β
    assert comm_seconds("all_reduce", (0, 1, 2, 3), 400, c) == approx(6 * 1.0 + 600 / 100)
    assert comm_seconds("all_reduce", (0,), 400, c) == 0.0
    # a group inside a node plays faster than one across
    trace = lambda a, b: Trace([rank_trace(r, Comm("all_reduce", (a, b), 1000)) if r in (a, b)  # noqa: E731
                                else rank_trace(r) for r in range(4)])
    assert replay(trace(0, 1), c, compute_scale=1).step_seconds < replay(trace(1, 2), c, compute_scale=1).step_seconds


def test_compute_scaled_to_the_device():
    """Without a card (a CPU declared by its measured FLOP/s): CPU seconds × (FLOP/s here ÷ FLOP/s there), or a
    segment's counted FLOPs ÷ FLOP/s there. On a card a segment must carry its counted operators."""
    trace = Trace([rank_trace(0, Compute(2.0, 2.0), Compute(0.0, 0.0, flops=4e10))])
    faster = this_machine(1e-4, 1e9, 4e10, devices=1)              # a CPU rank 4x this one's 1e10 FLOP/s
    res = replay(trace, faster, source_flops_per_second=1e10)
    # 2 CPU seconds at 1e10 FLOP/s here = 2e10 FLOPs at 4e10 FLOP/s = 0.5 s; the second segment 1 s by its FLOPs
    assert res.step_seconds == approx(2e10 / 4e10 + 1.0)
    with pytest.raises(ValueError, match="compute_scale"):
        replay(Trace([rank_trace(0, C(1.0))]), faster)
    with pytest.raises(ValueError, match="trace with ops=True"):
        replay(Trace([rank_trace(0, C(1.0))]), a100_cluster(1), compute_scale=1.0)
    with pytest.raises(ValueError, match="2 ranks, the cluster 1 devices"):
        replay(Trace([rank_trace(0), rank_trace(1)]), this_machine(1e-4, 1e9, 1e10, devices=1), compute_scale=1)


def test_declared_clusters():
    # the link cards: datasheet bandwidth per direction × the share a large ring reaches
    assert 2 * NVLINK3.bandwidth == 600e9 and a100_cluster(1).intra_bw == approx(300e9 * 0.77)  # NVLink 3, both ways
    h = h100_cluster(2)
    assert (h.devices, h.peak_flops, h.device) == (16, 989e12, H100_SXM)
    assert (h.intra_bw, h.inter_bw) == (approx(NVLINK4.beta), approx(IB_NDR.beta)) == (approx(360e9), approx(45e9))
    pcie = gpu_cluster(TITAN_RTX, 1, PCIE3, PCIE3, devices_per_node=2)   # seed 002's machine, NCCL_P2P_DISABLE=1
    assert (pcie.devices, pcie.memory_bytes, pcie.peak_flops) == (2, 24e9, 130e12)
    assert pcie.intra_bw == approx(15.75e9 * 0.8) and pcie.device is TITAN_RTX
    here = this_machine(2e-4, 5e8, 3e10, devices=4)
    assert (here.intra_latency, here.inter_bw, here.peak_flops * here.flops_efficiency) == (2e-4, 5e8, 3e10)


def test_marks_time_the_steps():
    # two steps, each: compute (rank 0: 1 s, rank 1: 2 s), a blocking all-reduce of 1 s, a mark
    def ranks(r, c):
        step = [C(c), Comm("all_reduce", (0, 1), 1000), Mark("step")]
        return RankTrace(r, [C(5.0 if r == 0 else 0.0)] + step + [C(c), Comm("all_reduce", (0, 1), 1000), Mark("step")])
    res = replay(Trace([ranks(0, 1.0), ranks(1, 2.0)]), cluster(), compute_scale=1.0)
    assert res.marks == [[("step", approx(7.0)), ("step", approx(10.0))]] * 2
    assert res.step_gaps("step") == [approx(3.0)]
    assert res.step_between("step") == approx(3.0)        # the slower rank's 2 s + the 1 s all-reduce
    with pytest.raises(ValueError, match="fewer than two marks 'other' on rank 0"):
        res.step_between("other")


def test_a_step_time_is_the_slowest_rank_per_step():
    # rank 0 computes 1 s then 3 s per step, rank 1 2 s then 1 s; each step ends in a blocking all-reduce
    # (2·0.1 + 1000/1000 = 1.2 s) and a mark. Step 1: both wait for rank 1 (2 s) -> 3.2; step 2: rank 0 takes
    # 3 s -> 4.2.
    ar = lambda: Comm("all_reduce", (0, 1), 1000)  # noqa: E731
    def rank(r, a, b):
        return RankTrace(r, [Mark("step"), C(a), ar(), Mark("step"), C(b), ar(), Mark("step")])
    res = replay(Trace([rank(0, 1.0, 3.0), rank(1, 2.0, 1.0)]), cluster(alpha=0.1), compute_scale=1.0)
    assert res.step_gaps() == [approx(3.2), approx(4.2)] and res.step_between("step") == approx(3.2)
    uneven = Trace([RankTrace(0, [Mark("step")] * 3), RankTrace(1, [Mark("step")] * 2)])
    with pytest.raises(ValueError, match="different number of marks 'step': \\[3, 2\\]"):
        replay(uneven, cluster(), compute_scale=1.0).step_gaps()


def test_step_time_takes_the_slowest_rank_of_each_step_not_each_ranks_fastest_step():
    # marks before each all-reduce (1 s), so the ranks' gaps differ: rank 0 computes 1, 3, 1 s, rank 1 3, 1, 3 s.
    # By hand: marks at 1 and 3; all-reduce 3..4; marks at 7 and 5; all-reduce 7..8; marks at 9 and 11.
    ar = lambda: Comm("all_reduce", (0, 1), 1000)  # noqa: E731
    def rank(r, a, b):
        return RankTrace(r, [C(a), Mark("step"), ar(), C(b), Mark("step"), ar(), C(a), Mark("step")])
    res = replay(Trace([rank(0, 1.0, 3.0), rank(1, 3.0, 1.0)]), cluster(), compute_scale=1.0)
    assert [[t for _, t in m] for m in res.marks] == [[approx(1), approx(7), approx(9)],
                                                      [approx(3), approx(5), approx(11)]]
    # gaps: rank 0 [6, 2], rank 1 [2, 6] -> per step the slowest [6, 6]; each rank's fastest step would be 2
    assert res.step_gaps() == [approx(6.0), approx(6.0)] and res.step_between("step") == approx(6.0)


def links(p, alpha):
    return Cluster(p, 1, 1e9, 1.0, 1e9, 1e9, alpha, alpha)


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2),
                                        ("zb-h1", 4, 8, 1)])
def test_replay_of_a_schedule_is_the_pipeline_simulator(name, p, m, v):
    """One engine's answer, two ways: the schedule's trace replayed (links of α = the simulator's p2p cost)
    gives every action the simulator's start and end."""
    from minipar.pipeline.schedules import make_schedule
    from minipar.pipeline.simulate import Costs, simulate
    schedule = make_schedule(name, p, m, v)
    costs = Costs(F=1.0, B=1.5, W=0.75, p2p=0.25)
    sim = simulate(schedule, costs)
    res = replay(from_schedule(schedule, costs), links(p, 0.25), compute_scale=1.0)
    for r in range(p):
        want = [(round(s.start, 9), round(s.end, 9)) for s in sim.timelines[r]]
        got = [(round(s.start, 9), round(s.end, 9)) for s in res.timelines[r] if s.kind == "compute"]
        assert got == want, f"rank {r}"
    assert res.step_seconds == approx(sim.makespan)
    assert sum(res.idle(r) + res.exposed(r) for r in range(p)) == approx(p * sim.makespan - sum(
        sim.busy(r) for r in range(p)))


def test_dualpipev_queues_on_a_shared_in_link():
    """DualPipeV sends into a middle rank from both sides at once: the replay queues the two messages on the
    rank's one in-link (the simulator's links are unlimited). Free transfers: the same timeline again."""
    from minipar.pipeline.schedules import make_schedule
    from minipar.pipeline.simulate import Costs, simulate
    schedule = make_schedule("dualpipev", 4, 8, 2)
    for p2p in (0.0, 0.25):
        costs = Costs(F=1.0, B=1.5, W=0.75, p2p=p2p)
        sim, res = simulate(schedule, costs), replay(from_schedule(schedule, costs), links(4, p2p), compute_scale=1)
        if p2p == 0:
            assert res.step_seconds == approx(sim.makespan)
        else:
            assert res.step_seconds > sim.makespan + 0.2
            # into rank 2 at t = 3.25: rank 1's F3@1 and rank 3's F0@4; the second waits for the first
            into_2 = sorted((round(start, 9), round(end, 9), ranks[0]) for op, ranks, start, end in res.calls
                            if ranks[1:] == (2,) and 3.2 < start < 3.6)     # a message's ranks: (src, dst)
            assert into_2 == [(3.25, 3.5, 1), (3.5, 3.75, 3)]


def test_a_send_and_a_receive_at_once_count_once():
    # a ring exchange on 2 ranks: each sends 1000 B to the other and receives 1000 B, both async, then waits.
    # The two transfers run at once (one link each way, 1 s each): 1 s of communication, not 2, and no idle.
    def ranks(r):
        peer = 1 - r
        return rank_trace(r, Comm("send", (r, peer), 1000, async_=True), Comm("recv", (peer, r), 1000, async_=True),
                          ("wait", 0), ("wait", 1))
    res = replay(Trace([ranks(0), ranks(1)]), cluster(), compute_scale=1.0)
    assert res.step_seconds == approx(1.0)
    assert (res.comm(0), res.exposed(0), res.idle(0)) == (approx(1.0), approx(1.0), approx(0.0))

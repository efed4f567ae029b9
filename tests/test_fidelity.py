"""minipar.machine.fidelity on hand-made traces (no processes): links per kind of call, wall-clock compute, FLOPs
copied between runs — each against a timeline worked out by hand (per-step times: tests/test_replay.py)."""
import pytest

from minipar.machine.fidelity import OpLinks, fit_link, observed_calls, ring_terms, wall_compute, with_flops, \
    with_ops, with_other_threads
from minipar.machine.cluster import Cluster, this_machine
from minipar.machine.replay import replay
from minipar.machine.trace import Comm, Compute, Mark, RankTrace, Trace, Wait

approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-12)  # noqa: E731
ONE = Cluster(2, 1, 1e9, 1.0, 1000.0, 1000.0, 0.1, 0.1)       # every call: α 0.1 s, β 1000 B/s


def two_ranks(*events):
    return Trace([RankTrace(r, list(events)) for r in range(2)])


def test_ring_terms():
    assert ring_terms("all_reduce", 4) == (6, 1.5) and ring_terms("all_gather", 4) == (3, 0.75)
    assert ring_terms("reduce_scatter", 2) == (1, 0.5) and ring_terms("send", 2) == (1, 1)
    with pytest.raises(ValueError, match="no ring form"):
        ring_terms("broadcast", 2)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("n", [2, 4])
def test_fit_link_gives_back_the_alpha_and_beta_the_times_were_made_of(op, n):
    k, f = ring_terms(op, n)
    alpha, beta = 3e-4, 4e8
    samples = {s: k * alpha + f * s / beta for s in (4, 2 ** 16, 2 ** 19, 2 ** 21)}
    bw, lat = fit_link(op, n, samples)
    assert bw == pytest.approx(beta, rel=1e-9) and lat == pytest.approx(alpha, rel=1e-9)
    # gloo's reduce-scatter as an all-reduce keeping one chunk: twice the ring's bytes -> half the fitted β
    doubled = {s: k * alpha + 2 * f * s / beta for s in samples}
    assert fit_link(op, n, doubled)[0] == pytest.approx(beta / 2, rel=1e-9)


def test_fit_link_error_weighting_relative_by_default_absolute_on_request():
    # noisy times over four decades: relative error fits the small sizes' α, seconds the large sizes' β
    samples = {16: 2e-4, 2 ** 12: 1e-4, 2 ** 20: 2.5e-3, 2 ** 24: 4.2e-2}
    xs, ys = list(samples), list(samples.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)        # plain least squares, by hand
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    k, f = ring_terms("all_reduce", 2)
    assert fit_link("all_reduce", 2, samples, error="absolute") == (approx(f / slope), approx((my - slope * mx) / k))
    relative = fit_link("all_reduce", 2, samples)
    assert fit_link("all_reduce", 2, samples, error="relative") == relative != \
        fit_link("all_reduce", 2, samples, error="absolute")
    with pytest.raises(ValueError, match="error must be one of"):
        fit_link("all_reduce", 2, samples, error="squared")


def test_fit_link_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="at least two sizes"):
        fit_link("all_reduce", 2, {4: 1e-4})
    with pytest.raises(ValueError, match="does not grow"):
        fit_link("all_reduce", 2, {4: 2e-3, 2 ** 20: 1e-3})


def test_op_links_time_each_kind_of_call_on_its_own_link():
    # rank 0: compute 1 s, send 100 B to rank 1, all-reduce 1000 B, reduce-scatter 1000 B (blocking each)
    r0 = RankTrace(0, [Compute(1.0, 1.0), Comm("send", (0, 1), 100), Comm("all_reduce", (0, 1), 1000),
                       Comm("reduce_scatter", (0, 1), 1000)])
    r1 = RankTrace(1, [Compute(1.0, 1.0), Comm("recv", (0, 1), 100), Comm("all_reduce", (0, 1), 1000),
                       Comm("reduce_scatter", (0, 1), 1000)])
    trace = Trace([r0, r1])
    # one link: send 0.1 + 0.1 = 0.2; all-reduce 2·0.1 + 1000/1000 = 1.2; reduce-scatter 0.1 + 500/1000 = 0.6
    assert replay(trace, ONE, compute_scale=1.0).step_seconds == approx(1 + 0.2 + 1.2 + 0.6)
    links = OpLinks({"all_reduce": (500.0, 0.2)}, p2p=(10_000.0, 0.001))
    # send on the ping-pong link: 0.001 + 100/10000 = 0.011; all-reduce on its own: 2·0.2 + 1000/500 = 2.4;
    # reduce-scatter not timed: the cluster's link, 0.6
    res = replay(trace, ONE, compute_scale=1.0, comm_time=links)
    assert res.step_seconds == approx(1 + 0.011 + 2.4 + 0.6)
    assert [round(end - start, 9) for _, _, start, end in res.calls] == [0.011, 2.4, 0.6]
    assert links.link("recv") == links.p2p and links.link("broadcast") is None


def test_wall_compute_replays_the_clock_not_the_cpu():
    # a segment that ran 1 s on the CPU but took 2.5 s on the clock (the core was shared)
    trace = two_ranks(Compute(1.0, 2.5), Comm("all_reduce", (0, 1), 1000), Compute(0.5, 0.5))
    assert replay(trace, ONE, compute_scale=1.0).step_seconds == approx(1 + 1.2 + 0.5)
    walled = wall_compute(trace)
    assert replay(walled, ONE, compute_scale=1.0).step_seconds == approx(2.5 + 1.2 + 0.5)
    assert walled.meta["compute"] == "wall" and trace.ranks[0].events[0].seconds_cpu == 1.0   # a copy


def test_other_threads_cpu_is_added_to_the_segment_it_ran_under():
    # 1 s of the rank's compute, during which gloo's threads used 0.4 s of CPU (an async all-reduce hidden
    # under it): one core per rank runs both, so the segment lasts 1.4 s
    trace = two_ranks(Compute(1.0, 1.5, seconds_other_threads=0.4), Comm("all_reduce", (0, 1), 1000), Compute(0.5, 0.5))
    assert replay(trace, ONE, compute_scale=1.0).step_seconds == approx(1 + 1.2 + 0.5)
    both = with_other_threads(trace)
    assert replay(both, ONE, compute_scale=1.0).step_seconds == approx(1.4 + 1.2 + 0.5)
    assert both.meta["compute"] == "cpu + other threads" and trace.ranks[0].events[0].seconds_cpu == 1.0


def test_with_flops_copies_counted_flops_and_the_replay_uses_them():
    timed = two_ranks(Compute(2.0, 2.0), Comm("all_reduce", (0, 1), 8), Compute(1.0, 1.0), Mark("step"))
    counted = two_ranks(Compute(9.0, 9.0, flops=3e10), Comm("all_reduce", (0, 1), 8),
                        Compute(5.0, 5.0, flops=0.0), Mark("step"))
    both = with_flops(timed, counted)
    assert [e.flops for e in both.ranks[0].events if isinstance(e, Compute)] == [3e10, 0.0]
    assert both.ranks[0].events[0].seconds_cpu == 2.0 and both.meta["flops"] == "counted"
    # on a CPU cluster of 3e10 FLOP/s a rank: 1 s of FLOPs, a zero-FLOP segment, the all-reduce of 8 B between
    cpu = this_machine(1e-4, 1e9, 3e10, devices=2)
    ar = 2 * cpu.intra_latency + 8 / cpu.intra_bw
    assert replay(both, cpu).step_seconds == approx(1.0 + ar)
    with pytest.raises(ValueError, match="events differ"):
        with_flops(timed, two_ranks(Compute(1.0), Comm("all_gather", (0, 1), 8), Compute(1.0), Mark("step")))
    with pytest.raises(ValueError, match="ranks"):
        with_flops(timed, Trace([RankTrace(0, [])]))


def test_waits_keep_their_place_when_flops_are_copied():
    events = [Compute(1.0), Comm("all_reduce", (0, 1), 8, async_=True, waited_at=3), Compute(1.0), Wait(1)]
    counted = [Compute(1.0, flops=5.0), Comm("all_reduce", (0, 1), 8, async_=True, waited_at=3),
               Compute(1.0, flops=7.0), Wait(1)]
    out = with_flops(two_ranks(*events), two_ranks(*counted))
    assert out.ranks[1].events[3] == Wait(1) and out.ranks[1].events[2].flops == 7.0


def test_with_ops_keeps_the_timed_seconds_and_a_card_prices_the_copied_ops():
    from minipar.machine.cluster import h100_cluster
    from minipar.machine.device import H100_SXM, ops_of, ops_seconds
    gemm = [{"name": "aten::mm", "kind": "gemm", "flops": 2e12, "bytes": 3e8, "count": 2}]
    timed = two_ranks(Compute(2.0, 2.0), Comm("all_reduce", (0, 1), 8), Mark("step"))
    counted = two_ranks(Compute(9.0, 9.0, flops=4e12, ops=gemm), Comm("all_reduce", (0, 1), 8), Mark("step"))
    both = with_ops(timed, counted)
    first = both.ranks[0].events[0]
    assert (first.seconds_cpu, first.flops, first.ops) == (2.0, 4e12, gemm)       # its time, their counts
    h100 = h100_cluster(1)
    ar = 2 * h100.intra_latency + 8 / h100.intra_bw
    assert replay(both, h100).step_seconds == approx(ops_seconds(ops_of(gemm), H100_SXM) + ar)
    with pytest.raises(ValueError, match="events differ"):
        with_ops(timed, two_ranks(Compute(1.0), Mark("step")))


def test_observed_calls_replay_each_blocking_collective_as_long_as_it_took():
    # rank 0 computes 1 s, rank 1 3 s, then a blocking all-reduce: rank 0 waited 2 s in it plus the call
    # (2.25 s on its clock), rank 1 only the call (0.25 s); then a second all-reduce that took 0.5 s on both,
    # and an async all-gather (its 0.01 s is the issue alone) waited for at the end
    r0 = RankTrace(0, [Compute(1.0, 1.0), Comm("all_reduce", (0, 1), 1000, seconds_wall=2.25),
                       Comm("all_reduce", (0, 1), 1000, seconds_wall=0.5),
                       Comm("all_gather", (1, 0), 1000, async_=True, waited_at=4, seconds_wall=0.01), Wait(3)])
    r1 = RankTrace(1, [Compute(3.0, 3.0), Comm("all_reduce", (0, 1), 1000, seconds_wall=0.25),
                       Comm("all_reduce", (0, 1), 1000, seconds_wall=0.5),
                       Comm("all_gather", (0, 1), 1000, async_=True, waited_at=4, seconds_wall=0.01), Wait(3)])
    trace = Trace([r0, r1])
    # the first call lasts the shorter of 2.25 and 0.25, the second 0.5; the async all-gather is on the
    # cluster's link (α 0.1, 500 B at 1000 B/s: 0.6); rank 0 waits for rank 1's 3 s
    res = replay(trace, ONE, compute_scale=1.0, comm_time=observed_calls(trace, OpLinks()))
    assert [round(end - start, 9) for _, _, start, end in res.calls] == [0.25, 0.5, 0.6]
    assert res.step_seconds == approx(3 + 0.25 + 0.5 + 0.6)
    # one callable per replay: a second replay with the same one has no times left, so it falls back
    used = observed_calls(trace, OpLinks())
    replay(trace, ONE, compute_scale=1.0, comm_time=used)
    again = replay(trace, ONE, compute_scale=1.0, comm_time=used)
    assert again.step_seconds == approx(3 + 1.2 + 1.2 + 0.6)

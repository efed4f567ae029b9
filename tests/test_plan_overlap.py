"""minipar.plan's overlap option and its agreement with the replay, on hand-built traces (no processes),
and the ranking check (Kendall's τ-b) on hand-made numbers."""
import math

import pytest

from minipar.data import zero_memory
from minipar.pipeline.schedule_trace import from_schedule
from minipar.pipeline.schedules import make_schedule
from minipar.pipeline.simulate import Costs
from minipar.plan import (Cluster, Layout, Transformer, agreement_text, estimate, kendall_tau, rank_agreement,
                          stage_parameters)
from minipar.plan.overlap import bucketed_exposed, prefetched_exposed
from minipar.machine.replay import replay
from minipar.machine.trace import Comm, Compute, Trace
from test_replay import rank_trace       # ("wait", i) tuples turned into Wait events

MODEL = Transformer(layers=4, hidden=64, heads=4, vocab=128, seq_len=32)
N = 4
# 1 FLOP/s peak (a trace's compute is its own seconds), every link α = 1 ms, β = 1 MB/s, no optimizer term
CLUSTER = Cluster(N, 1, 1e12, 1.0, 1e6, 1e6, 1e-3, 1e-3)
FP32 = dict(precision="fp32", dropout=False)


# --- the closed forms against a brute-force pipeline of k pieces on one link ---------------------------------------
@pytest.mark.parametrize("comm, backward, k", [(1.0, 4.0, 4), (4.0, 1.0, 4), (2.0, 2.0, 8), (3.0, 0.0, 3),
                                               (1.0, 10.0, 1)])
def test_bucketed_exposed_is_the_last_bucket_end(comm, backward, k):
    link_free = 0.0
    for i in range(1, k + 1):                   # bucket i ready at i/k of the backward, one at a time on the link
        link_free = max(link_free, i * backward / k) + comm / k
    assert bucketed_exposed(comm, backward, k) == pytest.approx(link_free - backward)


@pytest.mark.parametrize("g, w, k, r", [(1.0, 3.0, 5, 0.0), (3.0, 1.0, 5, 0.0), (1.0, 2.0, 4, 0.5)])
def test_prefetched_exposed_is_max_of_compute_and_comm_per_unit(g, w, k, r):
    # unit i+1's gather starts with unit i's compute; a blocking reduce-scatter after each unit
    t, gathered = g, None
    for i in range(k):
        gathered = t + g if i + 1 < k else None     # the prefetch, on the link while unit i computes
        t = max(t + w, gathered or 0.0) + r
    assert prefetched_exposed(g, w, k, r) == pytest.approx(t - k * w)


# --- the estimate against the replay of the program it models -------------------------------------------------------
def _ddp_trace(compute, buckets, bucket_bytes):
    """DDP as minipar.data.ddp runs it: forward, then the backward in `buckets` pieces, each followed by the
    async all-reduce of the bucket it filled; every bucket waited for at the end."""
    ranks = []
    for r in range(N):
        events = [Compute(compute / 3)]
        for _ in range(buckets):
            events += [Compute(2 * compute / 3 / buckets), Comm("all_reduce", tuple(range(N)), bucket_bytes, True)]
        events += [("wait", 2 + 2 * i) for i in range(buckets)]
        ranks.append(rank_trace(r, *events))
    return Trace(ranks)


@pytest.mark.parametrize("compute", [0.05, 0.5, 5.0])       # comm mostly exposed, partly hidden, all but one bucket
def test_ddp_buckets_estimate_equals_replay(compute):
    k, layout = 4, Layout(dp=N, micro_batch=2)
    grads = stage_parameters(MODEL, layout)["first"] * 4                     # fp32 gradient bytes
    kw = dict(FP32, bucket_bytes=grads / k * (1 + 1e-9), compute_seconds=compute)
    played = replay(_ddp_trace(compute, k, grads / k), CLUSTER, compute_scale=1.0).step_seconds
    model = estimate(MODEL, CLUSTER, layout, overlap="minipar", **kw)
    blocking = estimate(MODEL, CLUSTER, layout, **kw)
    assert model.step_seconds == pytest.approx(played, rel=1e-9)             # the same program, the same link
    assert estimate(MODEL, CLUSTER, layout, overlap=True, **kw).step_seconds == model.step_seconds  # DDP: both
    assert model.hidden["dp"] > 0 and model.hidden["dp"] + model.time["dp"] == pytest.approx(blocking.time["dp"])
    # without overlap the estimate over-predicts DDP by exactly the hidden communication
    assert blocking.step_seconds - played == pytest.approx(model.hidden_comm_seconds, rel=1e-9)


def _zero3_trace(compute, units, unit_bytes):
    """ZeRO-3 as minipar.data.zero runs it (one micro-batch): each unit's all-gather prefetched at the start
    of the previous unit's compute (the first blocking), forward and backward; a blocking reduce-scatter after
    each unit's backward."""
    group = tuple(range(N))
    ranks = []
    for r in range(N):
        events = []
        for share, reduce in ((1 / 3, False), (2 / 3, True)):
            events.append(Comm("all_gather", group, unit_bytes))
            for i in range(units):
                if i + 1 < units:
                    events.append(Comm("all_gather", group, unit_bytes, True))
                    prefetch = len(events) - 1
                events.append(Compute(compute * share / units))
                if reduce:
                    events.append(Comm("reduce_scatter", group, unit_bytes))
                if i + 1 < units:
                    events.append(("wait", prefetch))
        ranks.append(rank_trace(r, *events))
    return Trace(ranks)


@pytest.mark.parametrize("compute", [0.05, 0.5, 5.0])
def test_zero3_prefetch_estimate_equals_replay(compute):
    layout = Layout(dp=N, micro_batch=2, zero=3)
    units = MODEL.layers + 1
    psi = stage_parameters(MODEL, layout)["first"]
    trace = _zero3_trace(compute, units, psi * 4 / units)
    played = replay(trace, CLUSTER, compute_scale=1.0).step_seconds
    model = estimate(MODEL, CLUSTER, layout, overlap="minipar", compute_seconds=compute, **FP32)
    blocking = estimate(MODEL, CLUSTER, layout, compute_seconds=compute, **FP32)
    assert model.step_seconds == pytest.approx(played, rel=1e-9)
    assert blocking.step_seconds > played
    assert blocking.step_seconds - played == pytest.approx(model.hidden_comm_seconds, rel=1e-9)
    assert model.bytes_sent["dp"] == pytest.approx(zero_memory.bytes_sent_per_step(psi, N, 3, "fp32"))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_estimate_within_2_percent_of_replay(schedule):
    """The bubble formula is the schedule's timeline exactly; sends are not overlapped in the estimate (2m of
    them per rank) while the replay overlaps all but those on the critical path: within 2 % here (a send is
    1 % of a forward); overlap changes nothing for a pipeline."""
    p, m, b = 4, 8, 2
    layout = Layout(pp=p, schedule=schedule, micro_batch=b, micro_batches=m)
    act = MODEL.seq_len * b * MODEL.hidden * 4
    f = 1.0
    send = CLUSTER.intra_latency + act / CLUSTER.intra_bw
    trace = from_schedule(make_schedule(schedule, p, m), Costs(F=f, B=f, W=f), message_bytes=act)
    played = replay(trace, CLUSTER, compute_scale=1.0).step_seconds
    for overlap in (False, "minipar", True):
        e = estimate(MODEL, CLUSTER, layout, overlap=overlap, compute_seconds=3 * f * m, **FP32)
        assert e.hidden_comm_seconds == 0 and e.time["pp"] == pytest.approx(2 * m * send)
        assert e.step_seconds == pytest.approx(played, rel=0.02)
        assert e.step_seconds >= played


def test_overlap_true_also_hides_zero_1_and_2_reduce_scatters():
    for zero in (1, 2):
        layout = Layout(dp=N, micro_batch=2, zero=zero)
        kw = dict(FP32, compute_seconds=5.0, bucket_bytes=1e3)
        none, ours, prod = (estimate(MODEL, CLUSTER, layout, overlap=o, **kw) for o in (False, "minipar", True))
        assert ours.time["dp"] == none.time["dp"]                 # minipar's ZeRO-1/2 reduce-scatters block
        assert 0 < prod.time["dp"] < none.time["dp"] and prod.hidden["dp"] > 0
    with pytest.raises(ValueError, match="overlap must be"):
        estimate(MODEL, CLUSTER, Layout(dp=N), overlap="yes")


def test_estimate_prints_exposed_and_hidden_as_a_model():
    e = estimate(MODEL, CLUSTER, Layout(dp=N, zero=3), overlap="minipar", compute_seconds=1.0, **FP32)
    assert "model: comm exposed" in str(e) and "hidden" in str(e)
    assert "hidden" not in str(estimate(MODEL, CLUSTER, Layout(dp=N, zero=3), compute_seconds=1.0, **FP32))


# --- Kendall's τ-b and the ranking check -------------------------------------------------------------------------
def test_kendall_tau_known_values():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    # one swapped pair of 6: (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # a tie in y: pairs 6, tied in y 1, concordant 5, discordant 0 -> 5 / sqrt(6 · 5)
    assert kendall_tau([1, 2, 3, 4], [1, 2, 2, 4]) == pytest.approx(5 / math.sqrt(30))
    # scipy.stats.kendalltau([12, 2, 1, 12, 2], [1, 4, 7, 1, 0]) = -0.4714045207910316 (τ-b, its documented example)
    assert kendall_tau([12, 2, 1, 12, 2], [1, 4, 7, 1, 0]) == pytest.approx(-0.4714045207910316)
    assert math.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))
    # a gap of 4 %: a discordant pair all the same (no tolerance: ties are equal values)
    assert kendall_tau([1.0, 1.04, 2.0], [2.0, 1.0, 3.0]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="pair up"):
        kendall_tau([1, 2], [1])


def test_rank_agreement_orders_picks_and_ratios():
    predicted = {"DDP": 1.0, "ZeRO-3": 0.8, "TP": 3.0}
    observed = {"DDP": 1.0, "ZeRO-3": 1.2, "TP": 2.0}
    a = rank_agreement(predicted, observed)
    assert a["predicted_order"] == ["ZeRO-3", "DDP", "TP"] and a["observed_order"] == ["DDP", "ZeRO-3", "TP"]
    assert (a["predicted_pick"], a["observed_pick"], a["picks_agree"]) == ("ZeRO-3", "DDP", False)
    assert a["pick_gap"] == pytest.approx(1.2) and a["tau"] == pytest.approx(1 / 3)
    assert a["rows"][1] == {"name": "ZeRO-3", "predicted": 0.8, "observed": 1.2, "ratio": pytest.approx(2 / 3),
                            "predicted_rank": 1, "observed_rank": 2}
    # picks agree when the predicted pick is observed as fast as the best, though another strategy
    assert rank_agreement({"DDP": 1.0, "ZeRO-3": 0.8}, {"DDP": 1.0, "ZeRO-3": 1.0})["picks_agree"]
    text = agreement_text(a, unit=1.0, unit_name="s")
    assert "Kendall tau-b 0.333" in text and "pick ZeRO-3, observed best DDP: disagree (observed, the predicted pick is ×1.20 the best's time)" in text
    assert text.splitlines()[2].split() == ["ZeRO-3", "0.800", "s", "1.200", "s", "0.67", "1", "2"]
    with pytest.raises(ValueError, match="same strategies"):
        rank_agreement({"DDP": 1.0}, {"TP": 1.0})
    with pytest.raises(ValueError, match="positive"):
        rank_agreement({"DDP": 1.0, "TP": 0.0}, {"DDP": 1.0, "TP": 1.0})

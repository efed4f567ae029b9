"""minipar.plan.plan and the seeds' rules."""
import dataclasses

import pytest

from minipar.machine.cluster import IB_HDR, NVLINK3, gpu_cluster
from minipar.machine.device import A100_SXM_80GB
from minipar.plan import GPT3_175B, Layout, Transformer, a100_cluster, decide, estimate, family, layouts, plan

SMALL = Transformer(layers=8, hidden=256, heads=8, vocab=1024, seq_len=128)


def _node(memory_gb, nodes=1, inter_bw=IB_HDR.beta):
    """DGX A100 nodes (the device model) with ``memory_gb`` per GPU and ``inter_bw`` per InfiniBand port."""
    return dataclasses.replace(a100_cluster(nodes), memory_bytes=memory_gb * 1e9, inter_bw=inter_bw)


def test_plan_returns_the_fastest_fitting_layouts_in_order():
    p = plan(SMALL, _node(80), 64, tie=0)
    assert p.best and all(e.fits for e in p.best) and p.best[0] is p.fastest
    times = [e.step_seconds for e in p.best]
    assert times == sorted(times) and p.feasible >= len(p.best) and p.considered >= p.feasible
    assert all(e.layout.devices == 8 and e.layout.global_batch == 64 for e in p.best)
    # nothing fitting is faster than the winner
    for fam, e in p.families.items():
        if e.fits:
            assert e.step_seconds >= p.best[0].step_seconds - 1e-12


def test_rounded_up_rounds_a_spread_up_to_the_step():
    """The band is the spread rounded UP (a spread of 8.3 % is a 10 % band, exactly 10 % stays 10 %)."""
    from minipar.plan.published import rounded_up
    assert rounded_up(0.083) == pytest.approx(0.10)
    assert rounded_up(0.10) == pytest.approx(0.10)
    assert rounded_up(0.1001) == pytest.approx(0.15)
    assert rounded_up(0.042, step=0.01) == pytest.approx(0.05)


def test_plan_picks_the_least_memory_within_the_ranking_error():
    """Within the tie band (published.ranking_error: the widest model/published spread inside one source, 9.8 %
    -> 10 %) of the fastest, the best holds the least memory: for GPT-3 on 1024 A100s a TP 8 layout, not the
    nominally fastest TP 4 (the old plan() returned the fastest)."""
    from minipar.plan.published import ranking_error, spread_by_source, table
    spreads = spread_by_source(table())
    assert 1.09 < spreads["Korthikanti et al. 2022"] < 1.10 and 1.08 < spreads["Dubey et al. 2024 (Llama 3)"] < 1.09
    assert ranking_error() == pytest.approx(0.10)
    search = dict(recompute=("selective",), zero=(1,), micro_batch_sizes=(1,))
    p = plan(GPT3_175B, a100_cluster(128), 1536, **search)
    best, fastest = p.best[0], p.fastest
    assert p.tie == pytest.approx(0.10) and fastest.layout.tp == 4 and best.layout.tp == 8
    assert fastest.step_seconds < best.step_seconds <= 1.10 * fastest.step_seconds
    assert best.memory["total"] < 0.5 * fastest.memory["total"]
    assert plan(GPT3_175B, a100_cluster(128), 1536, tie=0, **search).best[0].layout == fastest.layout


def test_plan_picks_each_family_by_the_rule_of_the_pick():
    """Plan.picks: each family's layout by the pick's rule (inside the tie band of the fastest of all, the least
    memory; outside it, the family's fastest), brute-forced here, so families compare like with like. Chapter 12's
    table compared DP + TP + PP's fastest (TP 4, 18.9 s, 77 GB) with ZeRO-1's least-memory pick (TP 8, 20.7 s), and
    plain DP looked 9 % faster than ZeRO-1 (before, Plan had no picks)."""
    cluster, search = a100_cluster(128), dict(recompute=("selective",), zero=(0, 1), micro_batch_sizes=(1,))
    p = plan(GPT3_175B, cluster, 1536, **search)
    band, best = (1 + p.tie) * p.fastest.step_seconds, p.best[0]
    by_family = {}
    for lay in layouts(GPT3_175B, cluster, 1536, **search):
        e = estimate(GPT3_175B, cluster, lay)
        if e.fits:
            by_family.setdefault(family(lay) + (" (TP across nodes)" if lay.tp > 8 else ""), []).append(e)
    assert set(p.picks) == set(by_family) and p.picks[family(best.layout)] is best
    for fam, es in by_family.items():
        tied = [e for e in es if e.step_seconds <= band]
        want = min(tied, key=lambda e: e.memory["total"]) if tied else min(es, key=lambda e: e.step_seconds)
        assert p.picks[fam].layout == want.layout, fam
    dp = p.picks["DP + TP + PP"]
    assert dp is not p.families["DP + TP + PP"] and dp.memory["total"] > best.memory["total"]
    assert 0.95 < dp.step_seconds / best.step_seconds <= 1 + p.tie


def test_plan_rejects_families_with_reasons():
    p = plan(GPT3_175B, a100_cluster(128), 1536)
    winner = p.best[0]
    assert winner.layout.tp <= 8 and winner.layout.pp > 1 and winner.fits
    assert "DP + PP" in p.rejected and p.rejected["DP + PP"].startswith("does not fit")
    across = [k for k in p.rejected if "TP across nodes" in k]
    assert across and any("TP across nodes" in p.rejected[k] for k in across)
    for k in across:         # each does not fit, or is slower, its TP collectives dearer than the winner's in a node
        e = p.families[k]
        assert p.rejected[k].startswith("does not fit") if not e.fits else (
            "slower than the best" in p.rejected[k] and e.time["tp"] > winner.time["tp"])
    assert family(winner.layout) not in p.rejected


def test_plan_with_tiny_memory_finds_nothing_and_says_why():
    p = plan(SMALL, _node(0.001), 64)
    assert p.best == [] and p.rejected and all(r.startswith("does not fit") for r in p.rejected.values())


def test_plan_bad_batch():
    with pytest.raises(ValueError):
        plan(SMALL, _node(80), 0)
    with pytest.raises(ValueError, match="no layout"):
        plan(Transformer(1, 8, 1, 16, 8), _node(80), 3)


def test_family_names():
    assert family(Layout(dp=8)) == "DDP" and family(Layout(dp=8, zero=3)) == "ZeRO-3"
    assert family(Layout(dp=2, tp=2, pp=2, zero=1, micro_batches=2)) == "ZeRO-1 + TP + PP"
    assert family(Layout()) == "one device"


def test_rules_follow_the_seeds_guide():
    small_fits = decide(SMALL, _node(80))
    assert small_fits.families[0] == "DDP"
    one_gpu = gpu_cluster(A100_SXM_80GB, 1, NVLINK3, IB_HDR, devices_per_node=1)
    assert decide(GPT3_175B, one_gpu).families == ["ZeRO + offload"]
    assert decide(GPT3_175B, _node(80)).families == ["PP", "ZeRO-3", "TP"]
    assert decide(GPT3_175B, _node(80, nodes=128)).families == ["ZeRO-1 + TP + PP"]        # slow links
    assert decide(GPT3_175B, _node(80, nodes=128, inter_bw=200e9)).families == ["ZeRO-3", "DP + TP + PP"]
    assert "fast inter-node links?" in str(decide(GPT3_175B, a100_cluster(128)))


def test_estimate_agrees_with_plan():
    p = plan(SMALL, _node(80), 64, top=1)
    e = estimate(SMALL, _node(80), p.best[0].layout)
    assert e.step_seconds == pytest.approx(p.best[0].step_seconds)

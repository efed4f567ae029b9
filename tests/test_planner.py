"""minipar.plan.plan and the seeds' rules."""
import pytest

from minipar.plan import GPT3_175B, Cluster, Layout, Transformer, decide, dgx_a100, estimate, family, plan

SMALL = Transformer(layers=8, hidden=256, heads=8, vocab=1024, seq_len=128)


def _node(memory_gb, nodes=1, inter_bw=25e9):
    return Cluster(8, nodes, memory_gb * 1e9, 100e12, 300e9, inter_bw, 5e-6, 10e-6)


def test_plan_returns_the_fastest_fitting_layouts_in_order():
    p = plan(SMALL, _node(80), 64)
    assert p.best and all(e.fits for e in p.best)
    times = [e.step_seconds for e in p.best]
    assert times == sorted(times) and p.feasible >= len(p.best) and p.considered >= p.feasible
    assert all(e.layout.devices == 8 and e.layout.global_batch == 64 for e in p.best)
    # nothing fitting is faster than the winner
    for fam, e in p.families.items():
        if e.fits:
            assert e.step_seconds >= p.best[0].step_seconds - 1e-12


def test_plan_rejects_families_with_reasons():
    p = plan(GPT3_175B, dgx_a100(128), 1536)
    winner = p.best[0]
    assert winner.layout.tp <= 8 and winner.layout.pp > 1 and winner.fits
    assert "DP + PP" in p.rejected and p.rejected["DP + PP"].startswith("does not fit")
    across = [k for k in p.rejected if "TP across nodes" in k]
    assert across and all("TP across nodes" in p.rejected[k] or "does not fit" in p.rejected[k] for k in across)
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
    one_gpu = Cluster(1, 1, 80e9, 312e12, 300e9, 25e9)
    assert decide(GPT3_175B, one_gpu).families == ["ZeRO + offload"]
    assert decide(GPT3_175B, _node(80)).families == ["PP", "ZeRO-3", "TP"]
    assert decide(GPT3_175B, _node(80, nodes=128)).families == ["ZeRO-1 + TP + PP"]        # slow links
    assert decide(GPT3_175B, _node(80, nodes=128, inter_bw=200e9)).families == ["ZeRO-3", "DP + TP + PP"]
    assert "fast inter-node links?" in str(decide(GPT3_175B, dgx_a100(128)))


def test_estimate_agrees_with_plan():
    p = plan(SMALL, _node(80), 64, top=1)
    e = estimate(SMALL, _node(80), p.best[0].layout)
    assert e.step_seconds == pytest.approx(p.best[0].step_seconds)

"""Appendix A's model of time: the split of a card's seconds, rankings outside the spread, and a traced step on the A100 card bound below by its kernels × the launch floor."""
import math

import matplotlib
import pytest

from minipar.course.chA_how_minipar_measures import bench, time_model as tm
from minipar.machine.device import A100_SXM_80GB, Op, ops_seconds
from minipar.plan import GPT3_175B, Layout

matplotlib.use("Agg")


def test_bound_split_adds_up_to_the_card_s_seconds():
    ops = [Op("big gemm", "gemm", 2 * 4096 ** 3, 2 * 3 * 4096 ** 2, 1, 3),       # compute-bound on an A100
           Op("layernorm", "memory", 0.0, 4 * 2 ** 24, 1, 2),                    # memory-bound
           Op("tiny gemm", "gemm", 2 * 8 ** 3, 4 * 3 * 64, 1, 10)]               # floor-bound
    split = tm.bound_split(ops, A100_SXM_80GB)
    assert split["compute-bound"] + split["memory-bound"] + split["floor"] == pytest.approx(ops_seconds(ops, A100_SXM_80GB))
    assert split["kernels"] == 15 and split["floor"] == pytest.approx(15 * A100_SXM_80GB.launch_floor)
    gemm = 3 * 2 * 4096 ** 3 / (A100_SXM_80GB.peak_flops * A100_SXM_80GB.gemm_efficiency)
    assert split["compute-bound"] == pytest.approx(gemm)                          # by hand: F / (peak·η)
    hbm = A100_SXM_80GB.hbm_bandwidth * A100_SXM_80GB.memory_efficiency
    assert split["memory-bound"] == pytest.approx(2 * 4 * 2 ** 24 / hbm + 10 * 4 * 3 * 64 / hbm)


def _s(median, half=0.0):
    return {"median": median, "min": median - half, "max": median + half}


def test_ranking_counts_only_pairs_outside_the_spread():
    observed = {"A": _s(1.0, 0.1), "B": _s(1.15, 0.1), "C": _s(2.0, 0.1), "D": _s(3.0, 0.1)}
    predicted = {"A": 1.0, "B": 0.9, "C": 3.5, "D": 3.0}       # A/B inside the spread; C/D swapped outside it
    got = tm.ranking_outside_spread(predicted, observed)
    assert ("A", "B") in got["tied"] and got["swapped"] == [("C", "D")]
    assert (got["concordant"], got["discordant"], got["pairs"]) == (4, 1, 6)
    assert got["gamma"] == pytest.approx(3 / 5)
    assert math.isnan(tm.ranking_outside_spread({"A": 1, "B": 1}, {"A": _s(1, 0.5), "B": _s(1.2, 0.5)})["gamma"])
    assert tm.tied_first(observed) == ["A", "B"] and tm.tied_first({"A": _s(1), "B": _s(2)}) == ["A"]
    # a model's single numbers: within MODEL_TIE of each other they are tied, beyond it apart
    close = tm.ranking_outside_spread({"A": 1.0, "B": 1.001}, {"A": 2.0, "B": 2.0 * (1 + 2 * tm.MODEL_TIE)})
    assert close["tied"] == [("A", "B")]
    assert tm.ranking_outside_spread({"A": 1.0, "B": 1.1}, {"A": 2.0, "B": 2.5})["concordant"] == 1
    with pytest.raises(ValueError, match="same strategies"):
        tm.ranking_outside_spread({"A": 1}, {"B": _s(1)})


def test_step_times_refuses_a_table_of_other_strategies_before_any_process():
    table = {"ranks": 2, "rows": [{"name": "DDP", "measured": _s(0.1)}]}
    with pytest.raises(ValueError, match="the table measured"):
        bench.step_times({"ranks": 2}, names=["DDP", "TP"], measured=table)


def test_gpt3_at_real_size_is_not_launch_bound():
    layout = Layout(dp=16, tp=4, pp=16, v=2, zero=1, sp=True, recompute="selective", micro_batch=1,
                    micro_batches=96, schedule="interleaved")
    split = tm.planner_kernels(GPT3_175B, layout, A100_SXM_80GB)
    assert split["floor"] < 0.02 * (split["compute-bound"] + split["memory-bound"])
    assert split["compute-bound"] > split["memory-bound"]


def test_a_traced_step_on_the_a100_is_at_least_its_kernels_times_the_floor():
    got = tm.traced_on_a100("DDP", steps=2, n=2)
    assert got["kernels"] > 100 and got["floor"] == pytest.approx(got["kernels"] * A100_SXM_80GB.launch_floor)
    assert got["step"] >= got["floor"] and got["split"]["floor"] > got["split"]["compute-bound"]

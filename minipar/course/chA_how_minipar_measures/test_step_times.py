"""Appendix A's step-time calibration: what the benchmark returns and what the figure draws.

No timing is asserted here (speed is measured in ``python -m minipar bench calibrate``, not in tests):
these check the shape of the results, that every strategy of the figure is a layout the cost model
accepts, that the optimizer term is counted the way the docstring says, and that the figure draws.
"""
import math

import pytest

from minipar.course.chA_how_minipar_measures import bench, calibration, figures
from minipar.plan import Cluster, Layout, estimate, validate

FAKE_CAL = {"alpha": 1e-4, "beta": 3e9, "flops": 5e9, "optimizer_s_per_param": 2e-8, "allreduce_small_s": 1e-3,
            "alone_flops": 1e10, "matmul_flops": 5e10, "ranks": 2, "samples": {1024: 1e-4}}


@pytest.mark.parametrize("n", [2, 4])
def test_every_step_strategy_is_a_valid_layout_of_the_step_model_on_n_ranks(n):
    layouts = calibration.step_layouts(n)
    for name, layout in layouts.items():
        validate(calibration.STEP_MODEL, layout, calibration.calibrated_cluster(FAKE_CAL, n))
        assert layout.devices == n and layout.global_batch == calibration.STEP_BATCH, name
    assert {"DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "GPipe", "1F1B", "TP", "TP + SP"} <= set(layouts)
    assert 2 <= calibration.STEP_RANKS <= 4


def test_measured_compute_replaces_the_flop_count_and_the_optimizer_term_only():
    """estimate(compute_seconds=c): compute = c, no optimizer term (the measured step has it), the bubble
    scaled from c by the schedule's formula, the collectives unchanged."""
    c = Cluster(2, 1, 16e9, 1e10, 1e9, 1e9, optimizer_seconds_per_param=1e-8)
    m, layout = calibration.STEP_MODEL, calibration.step_layouts(2)["1F1B"]
    counted = estimate(m, c, layout, precision="fp32")
    cut = estimate(m, c, layout, precision="fp32", compute_seconds=0.05)
    assert cut.time["compute"] == 0.05 and "optimizer" not in cut.time and "optimizer" in counted.time
    assert cut.time["bubble"] / 0.05 == pytest.approx(counted.time["bubble"] / counted.time["compute"])
    assert cut.time["pp"] == counted.time["pp"] > 0
    assert cut.step_seconds == pytest.approx(sum(v for k, v in cut.time.items() if k != "total"))


def test_optimizer_term_counts_the_parameters_a_device_updates():
    c = Cluster(4, 1, 16e9, 1e10, 1e9, 1e9, optimizer_seconds_per_param=1e-8)
    m = calibration.STEP_MODEL
    ddp = estimate(m, c, Layout(dp=4, micro_batch=4), precision="fp32").time["optimizer"]
    zero1 = estimate(m, c, Layout(dp=4, micro_batch=4, zero=1), precision="fp32").time["optimizer"]
    assert zero1 == pytest.approx(ddp / 4)                 # ZeRO: each rank steps its 1/N shard
    tp = estimate(m, c, Layout(tp=4, micro_batch=16), precision="fp32").time["optimizer"]
    assert tp < ddp / 2                                    # TP: each rank holds ~1/t of the weights
    # the papers' clusters give no optimizer cost: the term is absent and their estimates are unchanged
    assert "optimizer" not in estimate(m, Cluster(4, 1, 16e9, 1e10, 1e9, 1e9), Layout(dp=4, micro_batch=4)).time


def test_the_links_are_fitted_to_gloo_s_all_reduce_when_it_was_timed():
    """allreduce_link inverts t = 2(n-1)·α + 2(n-1)/n · S/β: times made from a known α, β give them back, and
    the calibrated cluster then uses them instead of the ping-pong's."""
    alpha, beta = 2e-4, 6e8
    for n in (2, 4):
        cal = {**FAKE_CAL, **{f"allreduce_{s}_s": 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta
                              for s in calibration.ALLREDUCE_SIZES}}
        bw, hop = calibration.allreduce_link(cal, n)
        assert bw == pytest.approx(beta, rel=1e-9) and hop == pytest.approx(alpha, rel=1e-9)
        cluster = calibration.calibrated_cluster(cal, n)
        assert (cluster.intra_bw, cluster.intra_latency) == (bw, hop)
    assert calibration.allreduce_link(FAKE_CAL, 2) is None                  # not timed: the ping-pong's β
    assert calibration.calibrated_cluster(FAKE_CAL, 2).intra_bw == FAKE_CAL["beta"]


def test_first_calibration_scales_one_thread_by_the_share_of_cores():
    alone = calibration.calibrated_cluster(FAKE_CAL, contended=False)
    assert alone.optimizer_seconds_per_param == 0 and alone.peak_flops <= FAKE_CAL["alone_flops"]
    assert calibration.calibrated_cluster(FAKE_CAL).peak_flops == FAKE_CAL["flops"]


@pytest.fixture(scope="module")
def rows():
    # 2 steps, the fewest step_times takes (a step is the gap between two optimizer steps): what is asserted
    # is the rows' shape and terms, not a timing that more steps would steady
    return bench.step_times(FAKE_CAL, names=["DDP", "1F1B"], steps=2, repeats=1)


def test_step_times_returns_one_row_per_strategy_with_its_terms(rows):
    assert [r["name"] for r in rows] == ["DDP", "1F1B"]
    for r in rows:
        assert {"name", "layout", "measured", "predicted", "terms", "cut", "predicted_cut", "terms_cut",
                "predicted_alone", "calibration"} <= set(r)
        assert r["measured"] > 0 and math.isfinite(r["measured"]) and r["predicted"] > 0
        assert r["predicted"] == pytest.approx(sum(r["terms"].values()))
        assert r["predicted_cut"] == pytest.approx(sum(r["terms_cut"].values()))
        assert r["terms_cut"]["compute"] == r["cut"] > 0 and r["ranks"] == FAKE_CAL["ranks"]
        assert {"flops", "optimizer_s_per_param", "allreduce_small_s"} <= set(r["calibration"])
    assert "bubble" in rows[1]["terms"] and rows[0]["terms"]["dp"] > 0


def test_step_time_figure_draws_a_point_per_row(rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ax = figures.draw_step_times(rows)
    assert [len(c.get_offsets()) for c in ax.collections[-2:]] == [len(rows), len(rows)]   # counted, cut
    assert ax.get_xscale() == ax.get_yscale() == "log" and len(ax.texts) == len(rows)
    plt.close(ax.figure)
    assert "A_step_time_predicted_vs_measured.png" in figures.FIGURES

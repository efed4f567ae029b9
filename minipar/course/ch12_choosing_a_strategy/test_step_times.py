"""Chapter 12's step-time calibration: what the benchmark returns and what the figure draws.

No timing is asserted here (speed is measured in ``python -m minipar bench calibrate``, not in tests):
these check the shape of the results, that every strategy of the figure is a layout the cost model
accepts, that the optimizer term is counted the way the docstring says, and that the figure draws.
"""
import math

import pytest

from minipar.course.ch12_choosing_a_strategy import bench, figures
from minipar.plan import Cluster, Layout, estimate, validate

FAKE_CAL = {"alpha": 1e-4, "beta": 3e9, "flops": 5e9, "optimizer_s_per_param": 2e-8, "allreduce_small_s": 1e-3,
            "alone_flops": 1e10, "matmul_flops": 5e10, "samples": {1024: 1e-4}}


def test_every_step_strategy_is_a_valid_layout_of_the_step_model_on_4_ranks():
    for name, layout in bench.STEP_LAYOUTS.items():
        validate(bench.STEP_MODEL, layout, bench.calibrated_cluster(FAKE_CAL))
        assert layout.devices == 4 and layout.global_batch == bench.STEP_BATCH, name
    assert {"DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "GPipe", "1F1B", "TP", "TP + SP"} <= set(bench.STEP_LAYOUTS)


def test_optimizer_term_counts_the_parameters_a_device_updates():
    c = Cluster(4, 1, 16e9, 1e10, 1e9, 1e9, optimizer_seconds_per_param=1e-8)
    m = bench.STEP_MODEL
    ddp = estimate(m, c, Layout(dp=4, micro_batch=4), precision="fp32").time["optimizer"]
    zero1 = estimate(m, c, Layout(dp=4, micro_batch=4, zero=1), precision="fp32").time["optimizer"]
    assert zero1 == pytest.approx(ddp / 4)                 # ZeRO: each rank steps its 1/N shard
    tp = estimate(m, c, Layout(tp=4, micro_batch=16), precision="fp32").time["optimizer"]
    assert tp < ddp / 2                                    # TP: each rank holds ~1/t of the weights
    # the papers' clusters give no optimizer cost: the term is absent and their estimates are unchanged
    assert "optimizer" not in estimate(m, Cluster(4, 1, 16e9, 1e10, 1e9, 1e9), Layout(dp=4, micro_batch=4)).time


def test_first_calibration_scales_one_thread_by_the_share_of_cores():
    alone = bench.calibrated_cluster(FAKE_CAL, contended=False)
    assert alone.optimizer_seconds_per_param == 0 and alone.peak_flops <= FAKE_CAL["alone_flops"]
    assert bench.calibrated_cluster(FAKE_CAL).peak_flops == FAKE_CAL["flops"]


@pytest.fixture(scope="module")
def rows():
    return bench.step_times(FAKE_CAL, names=["DDP", "1F1B"], steps=3, repeats=1)


def test_step_times_returns_one_row_per_strategy_with_its_terms(rows):
    assert [r["name"] for r in rows] == ["DDP", "1F1B"]
    for r in rows:
        assert {"name", "layout", "measured", "predicted", "terms", "predicted_alone", "calibration"} <= set(r)
        assert r["measured"] > 0 and math.isfinite(r["measured"]) and r["predicted"] > 0
        assert r["predicted"] == pytest.approx(sum(r["terms"].values()))
        assert {"flops", "optimizer_s_per_param", "allreduce_small_s"} <= set(r["calibration"])
    assert "bubble" in rows[1]["terms"] and rows[0]["terms"]["dp"] > 0


def test_step_time_figure_draws_a_point_per_row(rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ax = figures.draw_step_times(rows)
    assert len(ax.collections[-1].get_offsets()) == len(rows)
    assert ax.get_xscale() == ax.get_yscale() == "log" and len(ax.texts) == len(rows)
    plt.close(ax.figure)
    assert "12_step_time_predicted_vs_measured.png" in figures.FIGURES

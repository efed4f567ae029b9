"""``bench replay`` end to end on 2 ranks, with a made-up calibration (no timing asserted: this is a test)."""
from minipar.course.bench import benchmarks
from minipar.course.ch12_choosing_a_strategy.replay_bench import replay_rows

CAL = {"ranks": 2, "flops": 2e10, "alpha": 5e-5, "beta": 5e9, "allreduce_small_s": 2e-4,
       "optimizer_s_per_param": 3e-9}


def test_registered():
    assert "replay" in benchmarks() and "calibrate" in benchmarks()


def test_replay_rows_for_ddp_and_1f1b():
    rows = replay_rows(CAL, steps=3)
    assert [r["name"] for r in rows] == ["DDP", "1F1B"]
    for r in rows:
        assert r["measured"] > 0 and r["replay_here"] > 0 and r["planner_here"] > 0
        # an A100 at 0.6 · 312 TFLOP/s against a CPU rank at 20 GFLOP/s: the replay there is far shorter
        assert r["replay_dgx_a100"] < r["replay_here"] / 100
        assert 0 <= r["exposed_share_here"] <= 1 and 0 <= r["idle_share_here"] <= 1

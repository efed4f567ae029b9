"""``bench replay`` end to end, tiny (2 ranks, 3 strategies, 2 runs of 2 steps, operators counted), with a made-up
calibration: no timing is asserted (this is a test, on a shared machine), only what the table is made of."""
import json

import pytest

from minipar.course.bench import benchmarks
from minipar.course.chA_how_minipar_measures import calibration
from minipar.course.chA_how_minipar_measures.replay_bench import AGREEMENTS, REPLAY_STRATEGIES, TOLERANCE, _miss, \
    _rankings, agreements_text, fidelity_table, format_table, main
from minipar.machine.fidelity import ring_terms

N = 2
ALPHA, BETA = 2e-4, 6e8
CAL = {"ranks": N, "flops": 2e10, "alpha": 5e-5, "beta": 5e9, "allreduce_small_s": 2e-4, "optimizer_s_per_param": 3e-9,
       **{f"{key}_{s}_s": ring_terms(op, N)[0] * ALPHA + ring_terms(op, N)[1] * s / (BETA / (2 if op == "reduce_scatter" else 1))
          for op, key in (("all_reduce", "allreduce"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"))
          for s in calibration.ALLREDUCE_SIZES}}
NAMES = ["DDP", "1F1B", "TP + SP"]


def test_registered_and_all_eight():
    assert "replay" in benchmarks() and "calibrate" in benchmarks()
    assert REPLAY_STRATEGIES == ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "GPipe", "1F1B", "TP", "TP + SP")


def test_op_links_from_the_calibration():
    links = calibration.op_links(CAL, N)
    assert links.ops["all_reduce"] == pytest.approx((BETA, ALPHA), rel=1e-9)
    assert links.ops["all_gather"] == pytest.approx((BETA, ALPHA), rel=1e-9)
    assert links.ops["reduce_scatter"] == pytest.approx((BETA / 2, ALPHA), rel=1e-9)   # gloo's: an all-reduce
    assert links.p2p == (CAL["beta"], CAL["alpha"])
    assert calibration.op_links({"alpha": 1e-5, "beta": 1e9}, N) is None                      # nothing timed per op


def _spread_row(name, measured, replay, planner, spread=0.0):
    """A table row with given medians (and ± ``spread`` as min/max) for the ranking checks."""
    one = lambda m: {"median": m, "min": m * (1 - spread), "max": m * (1 + spread),  # noqa: E731
                     "runs": [m * (1 - spread), m, m * (1 + spread)]}
    here = one(replay)             # the replay on the per-op links and on the planner's one link: alike here
    return {"name": name, "measured": one(measured), "replay_here": here, "replay_here_one_link": here,
            "replay_dgx_a100": one(replay / 1e3), "planner_here": planner, "planner_here_overlap": planner,
            "planner_dgx_a100": planner / 1e3, "planner_dgx_a100_overlap": planner / 1e3}


def test_rankings_use_plan_rank_agreement_and_say_when_picks_differ():
    rows = [_spread_row("A", 1.0, 1.1, 3.0), _spread_row("B", 2.0, 2.2, 2.0), _spread_row("C", 3.0, 3.3, 1.0)]
    r = _rankings(rows)
    assert set(r["agreements"]) == set(AGREEMENTS) and r["tau"]["replay vs measured, here"] == 1.0
    a = r["agreements"]["planner vs replay, here"]
    assert a["tau"] == -1.0 and (a["predicted_pick"], a["observed_pick"], a["picks_agree"]) == ("C", "A", False)
    assert a["pick_gap"] == pytest.approx(3.0) and a["columns"] == ["planner_here_overlap", "replay_here_one_link"]
    assert (a["pick_ahead_runs"], a["pick_within_spread"]) == (0, False)   # C behind A in every run
    text = agreements_text(r, ["planner vs replay, here"])
    assert "Kendall tau-b -1.000" in text and "disagree" in text and "in 0 of 3 runs — beyond" in text
    g = a["outside_spread"]                  # no spread here: every pair apart, all three swapped
    assert (g["concordant"], g["discordant"], g["tied"], g["gamma"]) == (0, 3, [], -1.0)
    assert "0 pairs in order, 3 swapped, 0 tied of 3; gamma -1.00" in text
    # paired runs: C (replay 1.3 ± 50 %) ahead of A (1.1 ± 50 %) in none of the same rounds, though the
    # spreads overlap; C tied with A run by run (only its median a hair slower): at or ahead in 3 of 3
    apart = _rankings([_spread_row("A", 1.0, 1.1, 3.0, 0.5), _spread_row("B", 2.0, 2.2, 2.0, 0.5),
                       _spread_row("C", 1.2, 1.3, 1.0, 0.5)])
    assert apart["agreements"]["planner vs replay, here"]["pick_ahead_runs"] == 0
    close = [_spread_row("A", 1.0, 1.1, 3.0, 0.5), _spread_row("B", 2.0, 2.2, 2.0, 0.5),
             _spread_row("C", 1.2, 1.1, 1.0, 0.5)]
    close[2]["replay_here"]["median"] = 1.1 * 1.0001              # C behind A on the median, tied run by run
    tied = _rankings(close)["agreements"]["planner vs replay, here"]
    assert (tied["observed_pick"], tied["pick_ahead_runs"], tied["pick_within_spread"]) == ("A", 3, True)
    assert "in 3 of 3 runs — the gap is inside the run-to-run spread" in agreements_text(_rankings(close))
    assert "us" in agreements_text(r, ["planner vs replay, DGX-A100"])        # a DGX step in microseconds


def _row(replay, threads, wall, seen=0.5, engine=0.5):
    return {"ratio_replay_here": {"median": replay}, "ratio_replay_here_threads": {"median": threads},
            "ratio_replay_here_wall": {"median": wall}, "ratio_replay_here_calls_seen": {"median": seen},
            "ratio_replay_here_engine": {"median": engine}}


def test_miss_names_the_term():
    assert _miss(_row(1 + TOLERANCE / 2, 3.0, 3.0)) is None
    assert "communication threads" in _miss(_row(0.5, 0.9, 1.0))
    assert "other processes" in _miss(_row(0.5, 0.6, 0.95))
    assert "inside the step than calibrated" in _miss(_row(0.5, 0.6, 0.6, seen=0.95))
    assert "communication and waiting" in _miss(_row(0.5, 0.6, 0.6))
    # the sign comes from the numbers: a replay longer than the run charges more than it took
    too_long = _miss(_row(1.4, 1.5, 1.6, seen=1.05))
    assert too_long.startswith("too long (x1.40)") and "cost less inside the step" in too_long
    assert _miss(_row(0.5, 0.6, 0.6)).startswith("too short (x0.50)")
    assert "together (the engine check)" in _miss(_row(0.5, 0.6, 0.6, seen=0.7, engine=0.97))


def test_bad_input_refused_before_any_process():
    with pytest.raises(ValueError, match="steps ≥ 2"):
        fidelity_table(CAL, steps=1)
    with pytest.raises(ValueError, match="runs ≥ 1"):
        fidelity_table(CAL, runs=0)
    with pytest.raises(ValueError, match="no strategy"):
        fidelity_table(CAL, names=["FSDP"])
    with pytest.raises(SystemExit):
        main(["--runs", "0"])


@pytest.fixture(scope="module")
def table():
    return fidelity_table(CAL, names=NAMES, steps=2, runs=2)


@pytest.mark.serial    # the replay here is priced on this machine's measured compute: alone, not beside a test
def test_the_table_per_strategy(table):
    rows = table["rows"]
    assert [r["name"] for r in rows] == NAMES and (table["ranks"], table["runs"], table["steps"]) == (N, 2, 2)
    for r in rows:
        for column in ("measured", "replay_here", "replay_here_one_link", "replay_here_threads", "replay_here_wall",
                       "replay_here_calls_seen", "replay_here_engine", "replay_dgx_a100"):
            s = r[column]
            assert len(s["runs"]) == 2 and 0 < s["min"] <= s["median"] <= s["max"], (r["name"], column)
        for column in ("replay_here", "replay_here_one_link", "replay_here_threads", "replay_here_wall",
                       "replay_here_calls_seen", "replay_here_engine"):
            ratios = [p / m for p, m in zip(r[column]["runs"], r["measured"]["runs"])]
            assert r[f"ratio_{column}"]["runs"] == pytest.approx(ratios)
        assert r["ratio_planner_here"] == pytest.approx(r["planner_here"] / r["measured"]["median"])
        assert 0 < r["planner_here_overlap"] <= r["planner_here"] and 0 < r["planner_dgx_a100_overlap"] <= r["planner_dgx_a100"]
        for where in ("here", "dgx_a100"):
            terms = r[f"planner_{where}_overlap_terms"]
            assert sum(terms.values()) == pytest.approx(r[f"planner_{where}_overlap"]) and terms["compute"] > 0
        assert r["calls_per_step"] > 0 and r["calls_per_step"] * 2 == int(r["calls_per_step"] * 2)
        # the operators priced on an A100 card: a model, one number, every run alike
        assert r["replay_dgx_a100"]["min"] == r["replay_dgx_a100"]["max"]
        assert r["replay_dgx_a100"]["median"] > 0     # how it compares with here is the bench's to show, not a test's
        assert r["miss"] is None or isinstance(r["miss"], str)


@pytest.mark.serial
def test_rankings_tau_and_picks(table):
    for k, order in table["rankings"].items():
        assert sorted(order) == sorted(NAMES) and table["picks"][k] == order[0]
    fastest = min(table["rows"], key=lambda r: r["measured"]["median"])["name"]
    assert table["picks"]["measured"] == fastest
    assert set(table["tau"]) == set(AGREEMENTS) and all(-1 <= t <= 1 for t in table["tau"].values())
    for label, (predicted, observed) in AGREEMENTS.items():
        a = table["agreements"][label]
        assert a["predicted_pick"] == table["picks"][predicted] and a["observed_pick"] == table["picks"][observed]
        assert [row["observed"] for row in a["rows"]] == sorted(row["observed"] for row in a["rows"])
    assert json.loads(json.dumps(table)) == table                  # what --json prints
    text = format_table(table)
    assert all(name in text for name in NAMES) and "Kendall tau-b" in text and "engine check" in text
    assert all(label in text for label in AGREEMENTS)
    assert format_table(table, agreements=False) + "\n" + agreements_text(table) == text

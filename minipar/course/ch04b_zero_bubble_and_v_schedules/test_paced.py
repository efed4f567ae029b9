"""Chapter 04b §4, paced: the claim fails when ZB-V is not better (a 1F1B-vs-1F1B pair), when a run is not equal
to one device or idles away from the simulator, and only says so when the load disturbed the runs; one real
launch of every schedule, paced, equal to one device and showing the lesson (or naming the overruns)."""
import dataclasses

import pytest

from minipar.course.ch04b_zero_bubble_and_v_schedules import claims
from minipar.course.ch04b_zero_bubble_and_v_schedules.paced import (PacedComparison, PacedSchedule, paced_runs,
                                                                    per_chunk)
from minipar.pipeline.paced import Pace

PACE = Pace(0.012, 0.0126, 0.0174)
ONE_F_ONE_B = PacedSchedule(0.273, 0.464, [0.271, 0.271, 0.272], [0.464, 0.464, 0.465], 0, 192, True)
ZB_V = PacedSchedule(0.066, 0.361, [0.069, 0.084, 0.080], [0.361, 0.369, 0.366], 23, 576, True)


def comparison(**rows):
    return PacedComparison({"1f1b": ONE_F_ONE_B, "zb-v": ZB_V, **rows}, PACE, load=1.0)


def test_the_claim_holds_silently_when_zb_v_idles_less_outside_the_spread(capsys):
    claims.check_paced_zb_v_idles_less_than_1f1b(comparison())
    assert capsys.readouterr().out == ""
    assert comparison().sentence() == ("ZB-V idles 8.0% (6.9%–8.4%) against 1F1B's 27.1% (27.1%–27.2%), outside the "
                                       "spread; its step takes 366 (361–369) ms against 464 (464–465) ms.")


def test_other_processes_cpu_judges_the_runs_where_it_was_measured():
    """The launch's OtherWork measurement, where there is one, decides whether the cores were the runs', not the load
    average: a high load with no other work leaves the runs undisturbed, other work at a low load disturbs them all."""
    rows = {"1f1b": ONE_F_ONE_B, "zb-v": dataclasses.replace(ZB_V, overruns=0)}
    assert PacedComparison(rows, PACE, load=9.0, other=0.05).disturbed == []
    shared = PacedComparison(rows, PACE, load=1.0, other=1.2)
    assert shared.disturbed == ["1f1b", "zb-v"]
    assert "zb-v: other processes used 1.2 of the" in str(shared) and "other processes 1.20 cores meanwhile" in str(shared)


def test_the_claim_fails_on_a_1f1b_pair_and_on_a_run_unlike_one_device_or_the_simulator():
    with pytest.raises(AssertionError):                                  # ZB-V no better: 1F1B against itself
        claims.check_paced_zb_v_idles_less_than_1f1b(comparison(**{"zb-v": ONE_F_ONE_B}))
    for overlapping in (dataclasses.replace(ZB_V, idle=[0.069, 0.28, 0.28]),      # median in 1F1B's spread
                        dataclasses.replace(ZB_V, idle=[0.069, 0.084, 0.3]),       # 1F1B's median in ZB-V's
                        dataclasses.replace(ZB_V, step=[0.361, 0.47, 0.47])):      # median step no faster
        with pytest.raises(AssertionError):
            claims.check_paced_zb_v_idles_less_than_1f1b(comparison(**{"zb-v": overlapping}))
    slow_step = dataclasses.replace(ZB_V, step=[0.361, 0.369, 0.9])    # one step lengthened: not the schedule
    claims.check_paced_zb_v_idles_less_than_1f1b(comparison(**{"zb-v": slow_step}))
    for wrong in (dataclasses.replace(ZB_V, matches=False), dataclasses.replace(ZB_V, simulated_idle=0.15)):
        with pytest.raises(AssertionError):
            claims.check_paced_zb_v_idles_less_than_1f1b(comparison(**{"zb-v": wrong}))
    assert "the spreads overlap" in comparison(**{"zb-v": ONE_F_ONE_B}).sentence()


def test_a_disturbed_run_is_named_instead_of_failing(capsys):
    late = dataclasses.replace(ONE_F_ONE_B, idle=[0.05, 0.3, 0.3], overruns=12)    # > 5 % of 192 actions
    claims.check_paced_zb_v_idles_less_than_1f1b(comparison(**{"1f1b": late}))
    assert "not shown this time: 1f1b overran" in capsys.readouterr().out
    overlapping = dataclasses.replace(ZB_V, idle=[0.069, 0.28, 0.28], overruns=0)        # no lesson, no overrun
    shared = PacedComparison({"1f1b": ONE_F_ONE_B, "zb-v": overlapping}, PACE, load=1.0, other=1.2)
    claims.check_paced_zb_v_idles_less_than_1f1b(shared)
    assert "not shown this time: 1f1b, zb-v ran while other processes used 1.2 cores" in capsys.readouterr().out


def test_a_chunk_gets_its_share_of_the_stage_slots():
    assert per_chunk(PACE, 2).costs(2) == PACE.costs(1) and per_chunk(PACE, 1) == PACE


def test_one_paced_launch_of_every_schedule_shows_the_lesson(capsys):
    runs, paced = paced_runs()
    assert set(paced.rows) == {"1f1b", "zb-h1", "zb-v", "dualpipev"} and len(runs) == 4
    claims.check_paced_zb_v_idles_less_than_1f1b(paced)      # fails, or names the overruns that kept it hidden
    out = capsys.readouterr().out
    assert out == "" or "not shown this time" in out, out

"""Chapter 04 checks: each passes the solution, fails on the stub, and rejects plausible wrong answers
(GPipe's order, one warm-up forward too many, the bubble ratio of Megatron's paper, the seed's fraction ÷ v).
Exact comparisons (bubble: 1e-9)."""
import pytest

from minipar.course.checks import ExerciseError
from minipar.course.ch04_pipeline_parallelism import checks as ch04


# -- 1. the 1F1B list -----------------------------------------------------------------------------------

def one_f_one_b_rank(p, m, r):
    warmup = p - r - 1
    acts = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        acts += [("F", warmup + i), ("BW", i)]
    return acts + [("BW", i) for i in range(m - warmup, m)]


def gpipe_rank(p, m, r):
    return [("F", i) for i in range(m)] + [("BW", i) for i in range(m)]


def one_warmup_too_many(p, m, r):
    warmup = min(p - r, m)
    acts = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        acts += [("F", warmup + i), ("BW", i)]
    return acts + [("BW", i) for i in range(m - warmup, m)]


def backward_first_in_steady_state(p, m, r):
    warmup = p - r - 1
    acts = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        acts += [("BW", i), ("F", warmup + i)]
    return acts + [("BW", i) for i in range(m - warmup, m)]


def stub(*args):
    raise NotImplementedError()


def test_1f1b_check_accepts_the_solution(capsys):
    ch04.check_one_f_one_b_rank(one_f_one_b_rank)
    assert "every rank's list is right" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,says", [(gpipe_rank, "that is GPipe"), (one_warmup_too_many, "warm-up"),
                                        (backward_first_in_steady_state, "warm-up")])
def test_1f1b_check_rejects(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        ch04.check_one_f_one_b_rank(wrong)


def test_1f1b_check_fails_on_the_stub():
    with pytest.raises(NotImplementedError):
        ch04.check_one_f_one_b_rank(stub)


# -- 2. the bubble fraction -------------------------------------------------------------------------------

@pytest.mark.parametrize("wrong,says", [
    (lambda p, m, v: (p - 1) / (v * m), "Megatron's ratio"),
    (lambda p, m, v: (p - 1) / (m + p - 1) / v, "not the fraction"),
    (lambda p, m, v: (p - 1) / (m + p - 1), "ignores v"),
])
def test_bubble_check_rejects(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        ch04.check_bubble_fraction(wrong)


def test_bubble_check_accepts_the_solution_and_fails_on_the_stub():
    ch04.check_bubble_fraction(lambda p, m, v: (p - 1) / (v * m + p - 1))
    with pytest.raises(NotImplementedError):
        ch04.check_bubble_fraction(stub)


def test_a_busy_machine_compares_no_paced_schedule():
    """On more than twice as many runnable processes as cores the paced check is skipped for every schedule (ranks
    wake late at their slots' ends without overrunning), and the table says why; on a quiet one it is made, and a
    schedule with more than 5 % of its actions overrun (paced_compute's shared rule, as chapters 02-04b) is not."""
    from minipar.course.ch04_pipeline_parallelism.figures import PacedIdle
    rows = {"1f1b": (0.273, 0.445, 0, 64), "gpipe": (0.273, 0.27, 1, 64)}
    busy, quiet = PacedIdle(rows, 0.02, load=9.0, cores=2), PacedIdle(rows, 0.02, load=1.5, cores=2)
    assert busy.disturbed == ["1f1b", "gpipe"] and busy.agrees()
    assert "every schedule: load average 9.0 on 2 cores" in str(busy) and "not compared" in str(busy)
    assert quiet.disturbed == [] and not quiet.agrees()          # 44.5 % against 27.3 %: a real disagreement
    lines = str(quiet).splitlines()                              # an overrun is printed only where there is one
    assert "overran" not in lines[1] and "(1 of 64 actions overran their slots)" in lines[2]
    assert lines[3] == "slots that ran long: 1 of 128"            # counted even when none ran long
    overran = PacedIdle(dict(rows, gpipe=(0.273, 0.35, 4, 64)), 0.02, load=1.5, cores=2)   # 6 %: not 10 %
    assert overran.disturbed == ["gpipe"] and "gpipe: more than 5% of the slots ran long" in str(overran)


def test_other_processes_cpu_judges_the_paced_runs_where_it_was_measured():
    """paced_runs measures the other processes' CPU while its launch ran (OtherWork): then that, not the load average
    (which also counts the chapter's own earlier runs), says whether the cores were the runs'."""
    from minipar.course.ch04_pipeline_parallelism.figures import PacedIdle, PacedRuns
    rows = {"1f1b": (0.273, 0.28, 0, 64), "gpipe": (0.273, 0.27, 0, 64)}
    assert PacedIdle(rows, 0.02, load=9.0, cores=2, other=0.05).disturbed == []
    shared = PacedIdle(rows, 0.02, load=1.5, cores=2, other=1.2)
    assert shared.disturbed == ["1f1b", "gpipe"]
    assert "every schedule: other processes used 1.2 of the 2 cores while it ran" in str(shared)
    runs = PacedRuns({"k": 1}, other_cores=0.7)
    assert dict(runs) == {"k": 1} and runs.other_cores == 0.7


def test_the_paced_verdict_follows_the_load_check(capsys):
    """Both branches of §6's verdict on made-up tables, no quiet machine needed: a loaded run (load average 50 on
    2 cores, most slots overrun, 1F1B below its own bubble) prints that it is not evidence, and its disturbed list,
    on which the notebook skips the reveal, is full; a quiet one within 5 points prints each schedule's distance
    from its simulation."""
    from minipar.course.ch04_pipeline_parallelism.figures import PacedIdle
    from minipar.course.ch04_pipeline_parallelism.report import report_paced
    busy = PacedIdle({"gpipe": (0.273, 0.160, 63, 64), "1f1b": (0.273, 0.104, 58, 64),
                      "interleaved": (0.158, 0.434, 124, 128)}, 0.02, load=50.0, cores=2)
    report_paced(busy)
    out = capsys.readouterr().out
    assert busy.disturbed == ["gpipe", "1f1b", "interleaved"]           # the notebook reveals only when this is empty
    assert "This run is not evidence: other load took the cores (every schedule;" in out
    assert "not revealed" in out and "within" not in out
    quiet = PacedIdle({"gpipe": (0.273, 0.291, 0, 64), "1f1b": (0.273, 0.285, 0, 64),
                       "interleaved": (0.158, 0.170, 1, 128)}, 0.02, load=1.0, cores=2)
    report_paced(quiet)
    out = capsys.readouterr().out
    assert quiet.disturbed == []
    assert "every schedule idles within 1.8 points of its simulation (GPipe +1.8, 1F1B +1.2, interleaved +1.2 points)" in out
    assert "GPipe and 1F1B lie 0.6 points apart; interleaving idles least" in out and "not evidence" not in out
    assert "All sit slightly above: a late wake-up in the step's last action" in out
    below = PacedIdle({"gpipe": (0.273, 0.272, 0, 64), "1f1b": (0.273, 0.266, 0, 64),
                       "interleaved": (0.158, 0.155, 0, 128)}, 0.02, load=1.0, cores=2)   # the sign of a quiet run
    report_paced(below)
    out = capsys.readouterr().out
    assert "(GPipe -0.1, 1F1B -0.7, interleaved -0.3 points)" in out
    assert "All sit slightly below: a sleep that wakes late lengthens its action's span, which counts as busy" in out
    one = PacedIdle({"gpipe": (0.273, 0.291, 0, 64), "1f1b": (0.273, 0.30, 9, 64)}, 0.02, load=1.0, cores=2)
    report_paced(one)                                           # one schedule disturbed: still no evidence
    out = capsys.readouterr().out
    assert one.disturbed == ["1f1b"] and "not evidence: other load took the cores (1F1B;" in out


def test_the_ladders_last_line_follows_the_sign_of_measured_minus_replay():
    """Deeper A: wake-up delay is offered only where the measured run idles more than the replay with shared cores."""
    from minipar.course.ch04_pipeline_parallelism.report import ladder_reading
    idle = dict(formula=0.27, stages=0.34, p2p=0.36, cores=0.62, dgx_a100=0.34)
    below = ladder_reading({**idle, "measured": 0.55}, cores=2)          # the published page's run
    above = ladder_reading({**idle, "measured": 0.70}, cores=2)
    level = ladder_reading({**idle, "measured": 0.618}, cores=2)
    assert "7 points less than the last replay" in below and "counts some waiting twice" in below
    assert "wake-up" not in below
    assert "8 points more than the last replay" in above and "wake-up delay" in above and "one of the 2 cores" in above
    assert "to the point" in level

"""Appendix A: the cost model against this course's own runs.

The runs are tour rows (their strategies on 4 CPU ranks, their recipes): the bytes each rank sent, read
from the communication log, must equal the cost model's for the same layout exactly; the memory it
measured must be within 10 % of the prediction (ZeRO-1 and ZeRO-3 on minipar's rings: model states + the
step's peak; TP and TP+SP: one layer's activations; the 1F1B and ZB-H1 pipelines: what their step created —
ZB-H1's busiest rank is the last, which its deferred W makes hold p micro-batches and their logits). The other
rows of ``bench.TOUR_LAYOUTS`` (DDP, ZeRO-2, interleaved, DDP with recomputation) are compared in the
appendix's figure (``python -m minipar figures -k A_``); they are left out here to keep this file fast.
"""
import pytest

from minipar.course.chA_how_minipar_measures import bench

ROWS = ["ZeRO-1 ring", "ZeRO-3 ring", "pipeline 1F1B", "pipeline zero bubble ZB-H1", "tensor parallel",
        "tensor parallel + sequence parallel"]


@pytest.fixture(scope="module")
def measured(tour_row):
    """The rows chapters 03, 04, 04b and 05 check in their tour tests: the session's runs (conftest.tour_row)."""
    return bench.compare_with_tour(ROWS, run_row=tour_row)


def test_bytes_per_rank_equal_the_communication_log(measured):
    for r in measured:
        assert r["matches"], r["strategy"]
        assert r["bytes_measured"] == pytest.approx(r["bytes_predicted"], abs=0.5), r


def test_memory_within_ten_percent_of_measured(measured):
    for r in measured:
        assert r["memory_measured"], r
        assert abs(r["memory_predicted"] / r["memory_measured"] - 1) <= 0.10, r


def test_every_tour_layout_is_valid():
    for name in bench.TOUR_LAYOUTS:
        p = bench.predict(name)
        assert p["bytes"] > 0 and (p["memory"] is None or p["memory"] > 0)


# ----------------------------------------------------------------------------------------------------
# the exercise: count a ranking outside the spread
# ----------------------------------------------------------------------------------------------------

def _apart(x, y):
    return x["max"] < y["min"] or y["max"] < x["min"]


def pairs_solution(predicted, measured):
    names, c, d, t = sorted(measured), 0, 0, 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if not (_apart(predicted[a], predicted[b]) and _apart(measured[a], measured[b])):
                t += 1
            elif (predicted[a]["median"] < predicted[b]["median"]) == (measured[a]["median"] < measured[b]["median"]):
                c += 1
            else:
                d += 1
    return c, d, t


def pairs_by_medians(predicted, measured):          # every pair ordered, overlapping ranges or not
    names, c, d = sorted(measured), 0, 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            same = (predicted[a]["median"] < predicted[b]["median"]) == (measured[a]["median"] < measured[b]["median"])
            c, d = (c + 1, d) if same else (c, d + 1)
    return c, d, 0


def pairs_measured_side_only(predicted, measured):  # ties judged on the measurement alone
    names, c, d, t = sorted(measured), 0, 0, 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if not _apart(measured[a], measured[b]):
                t += 1
            elif (predicted[a]["median"] < predicted[b]["median"]) == (measured[a]["median"] < measured[b]["median"]):
                c += 1
            else:
                d += 1
    return c, d, t


def test_count_pairs_check_accepts_the_solution_and_names_the_mistakes(capsys):
    from minipar.course.checks import ExerciseError
    from minipar.course.chA_how_minipar_measures import checks
    checks.check_count_pairs(pairs_solution)
    assert "right:" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match="counts for neither"):
        checks.check_count_pairs(pairs_by_medians)
    with pytest.raises(ExerciseError, match="both sides"):
        checks.check_count_pairs(pairs_measured_side_only)

    def stub(predicted, measured):
        raise NotImplementedError()
    with pytest.raises(NotImplementedError):
        checks.check_count_pairs(stub)

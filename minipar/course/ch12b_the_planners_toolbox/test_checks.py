"""Chapter 12b: the exercise check, against the stub and plausible wrong answers kept here."""
import pytest

from minipar.course.checks import ExerciseError
from minipar.course.ch12b_the_planners_toolbox import checks


def days_right(parameters, tokens, gpus, flops_per_gpu, recompute):
    return (8 if recompute == "full" else 6) * tokens * parameters / (gpus * flops_per_gpu) / 86400


def days_stub(*args):
    raise NotImplementedError


def days_always_6(parameters, tokens, gpus, flops_per_gpu, recompute):
    return 6 * tokens * parameters / (gpus * flops_per_gpu) / 86400


def days_in_seconds(parameters, tokens, gpus, flops_per_gpu, recompute):
    return days_right(parameters, tokens, gpus, flops_per_gpu, recompute) * 86400


def test_right_answer_passes_and_gpt3_takes_34_days(capsys):
    checks.check_training_days(days_right)
    assert "34 days" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [(days_always_6, "recomputed forward"), (days_in_seconds, "86,400")])
def test_wrong_answers_are_named(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        checks.check_training_days(wrong)


def test_stub_raises():
    with pytest.raises(NotImplementedError):
        checks.check_training_days(days_stub)

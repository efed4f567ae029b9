"""predict.reveal: the verdicts a learner sees after a predict-first cell."""
import pytest

from minipar.course import predict
from minipar.course.predict import reveal, verdict


@pytest.fixture
def fresh_kernel(monkeypatch):
    """A process in which no reveal has yet printed the long no-guess sentence."""
    monkeypatch.setattr(predict, "_told_how_to_guess", False)


def test_verdicts():
    assert verdict(None, 3).startswith("no guess")
    assert verdict(100, 105).startswith("right")
    assert verdict(200, 100) == "off by ×2"
    assert verdict(50, 100) == "off by ×1/2"
    assert verdict("1F1B", "1f1b") == "right"
    assert verdict("gpipe", "1f1b") == "not what happened"
    assert verdict(0, 0) == "right" and verdict(1, 0).startswith("off")


def test_reveal_shows_measured_formula_and_guess(capsys):
    line = reveal(1024, 1536, what="bytes sent per rank", formula=1536, unit="B")
    assert capsys.readouterr().out.strip() == line
    assert "measured 1,536 B" in line and "formula 1,536 B" in line and "your guess 1,024 B" in line
    assert line.endswith("off by ×1/1.5")


def test_a_missing_guess_says_what_to_type_and_the_line_is_shown_once(capsys, fresh_kernel):
    line = reveal(None, 12, what="all-reduces per layer", formula=12)
    assert capsys.readouterr().out.count("all-reduces per layer") == 1
    assert "your guess" not in line and "type your number" in line and "measured 12" in line
    assert hasattr(line, "_ipython_display_") and line._ipython_display_() is None   # not displayed a second time


def test_the_long_no_guess_sentence_is_printed_once_per_kernel(capsys, fresh_kernel):
    first = reveal(None, 12, what="all-reduces per layer")
    second = reveal(None, 4, what="all-gathers per layer")
    out = capsys.readouterr().out
    assert out.count(predict.NO_GUESS) == 1 and predict.NO_GUESS in first
    assert second.endswith("->  no guess written") and "type your number" not in second
    assert verdict(None, 3) == predict.NO_GUESS          # verdict itself stays a pure function of its arguments
    assert reveal(7, 7, what="x").endswith("right (within 10%)")   # a written guess is judged as before

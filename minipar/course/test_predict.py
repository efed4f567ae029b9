"""predict.reveal: the verdicts a learner sees after a predict-first cell."""
from minipar.course import predict
from minipar.course.predict import reveal, verdict


def test_verdicts():
    assert verdict(None, 3) == "no guess"
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


def test_a_missing_guess_shows_the_answer_without_instructions(capsys):
    line = reveal(None, 12, what="all-reduces per layer", formula=12)
    second = reveal(None, 4, what="all-gathers per layer")
    out = capsys.readouterr().out
    assert out.count("all-reduces per layer") == 1 and "measured 12" in line and "formula 12" in line
    assert line == "all-reduces per layer: measured 12; formula 12." and second == "all-gathers per layer: measured 4."
    assert "guess" not in out.lower()
    assert "guess written" not in out and "type your number" not in out and "cell" not in out
    assert hasattr(line, "_ipython_display_") and line._ipython_display_() is None   # not displayed a second time
    assert reveal(7, 7, what="x").endswith("right (within 10%)")   # a written guess is judged as before


def test_reveal_labels_an_answer_that_is_not_a_measurement(capsys):
    line = str(reveal(0.4, 3 / 7, what="GPipe idle fraction", source="simulated"))
    assert line.startswith("GPipe idle fraction: simulated 0.4286") and "measured" not in line


def test_show_source_reads_the_library_live_dedented_and_folds_under_a_summary():
    from minipar.course.report import show_source
    from minipar.hybrid.parallel3d import Trainer3D
    text = show_source(Trainer3D.step, folded="the step").data
    assert text.startswith("<details><summary>the step</summary>\n\n```python\n@") and "\ndef step(" in text
    from minipar.course.report import against_one_device
    plain = show_source(against_one_device).data
    assert plain.startswith("```python\ndef against_one_device(") and "<details>" not in plain

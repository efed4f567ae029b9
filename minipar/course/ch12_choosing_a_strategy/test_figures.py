"""Chapter 12's figures: the published runs' figure draws every row, and the calculator shows a table, not an
``Estimate``'s repr, and offers the cards."""
import re

import matplotlib

from minipar.course.ch12_choosing_a_strategy import figures
from minipar.plan import published

matplotlib.use("Agg")


def test_published_figure_draws_every_row():
    rows = published.table()
    ax = figures.draw_published(rows)
    assert len(ax.texts) == len(rows)
    drawn = sum(len(c.get_offsets()) for c in ax.collections if c.get_label().startswith(("calibration", "weak check", "independent check")))
    assert drawn == len(rows) and {r["role"] for r in rows} == {"calibration", "check"}


def test_calculator_shows_a_table_and_offers_the_cards(capsys):
    import matplotlib
    matplotlib.use("Agg")
    assert figures.draw_calculator() is None
    out = capsys.readouterr().out
    assert "Estimate(" not in out and "MFU" in out and not re.search(r"\d\.\d{6,}", out)
    views = {name: figures.calculate(cluster=name) for name in figures.CALCULATOR_CLUSTERS}
    assert any(e.memory_limit and "H100" in name for name, e in views.items())
    assert len({e.step_seconds for e in views.values()}) == len(views)

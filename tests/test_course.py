"""The course's shape and its runners.

* One chapter, one name: ``notebooks/NN_topic.ipynb``, ``minipar/course/chNN_topic/``, and where they exist
  ``solutions/NN_topic.ipynb``, ``exercises/NN_topic.ipynb`` and figures ``NN_*.png``.
* The figure generator: every registered figure (a chapter's ``figures.py`` ``FIGURES``) is made by
  ``minipar.course.figures.generate`` into a temporary folder and is a non-empty PNG. One test per figure, so
  a slow or broken chapter is named; the committed ``figures/`` holds a PNG for every registered figure.
"""
import pytest

from minipar.course import ROOT, chapters, collect, figures
from minipar.course.bench import benchmarks
from minipar.course.tour import strategies


def test_every_chapter_folder_has_its_notebook_and_every_notebook_its_folder():
    names = {c.name for c in chapters()}
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert names == notebooks, (sorted(names ^ notebooks), "a chapter is notebooks/NN_topic.ipynb + "
                                "minipar/course/chNN_topic/ (see minipar/course/__init__.py)")
    solutions = {p.stem for p in (ROOT / "solutions").glob("*.ipynb")}
    assert solutions <= names, sorted(solutions - names)


def test_each_chapter_registers_only_figures_named_after_it():
    for chapter, registered in collect("figures", "FIGURES"):
        for name in registered:
            assert name.startswith(chapter.number + "_") and name.endswith(".png"), (chapter.name, name)


def test_runners_find_every_chapter_s_pieces():
    assert len(strategies()) >= 38 and len(set(name for _, name, _ in strategies())) == len(strategies())
    assert {"ddp", "zero", "pipeline", "tp", "recompute"} <= set(benchmarks())

NAMES = sorted(figures.all_figures())
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", NAMES)
def test_generator_writes_a_nonempty_png(name, tmp_path):
    written = figures.generate(str(tmp_path), select=name)
    path = tmp_path / name
    assert str(path) in written and path.exists(), name
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, f"{name}: {len(data)} bytes, not a PNG picture"


def test_every_registered_figure_is_committed_in_figures_folder():
    missing = [n for n in NAMES if not (ROOT / "figures" / n).exists()]
    assert not missing, f"run `python -m minipar figures` and commit: {missing}"

"""The course as a learner meets it: JupyterLab in a real browser (headless Chromium through Playwright).

For every chapter with widgets (found by reading the notebooks, so later chapters' widgets are covered):
run all cells in JupyterLab, check that no cell shows an error, that each widget's first view is a picture
or a number and not an error message, and that moving each of its enabled sliders changes what it shows.
Screenshots are kept in tests/browser/artifacts/ (gitignored). Chapters without widgets are executed by
nbval and the site build instead, which keeps this test to about two minutes on two cores.

Needs Chromium and playwright: tools/setup_browser.sh installs both (idempotent). Without them the test
fails and says so, unless MINIPAR_SKIP_BROWSER=1. MINIPAR_BROWSER_NOTEBOOKS=path1,path2 tests other
notebooks (paths relative to the repository root).
"""
import json
import os
import re
from pathlib import Path

import pytest

from labdriver import (ARTIFACTS, ERROR_TEXT, ROOT, browser, chinese_fonts, course_path, find_chromium, how_to_set_up,
                       jupyterlab, run_chapter)


def is_widget_cell(cell: dict) -> bool:
    """A code cell that builds widgets itself (imports ipywidgets), or calls a chapter helper that displays them
    and says so with the cell tag ``widget``."""
    return cell["cell_type"] == "code" and (re.search(r"\bipywidgets\b", "".join(cell["source"])) is not None
                                            or "widget" in cell.get("metadata", {}).get("tags", []))


def notebooks_with_widgets() -> list[Path]:
    return [path for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
            if any(is_widget_cell(c) for c in json.loads(path.read_text())["cells"])]


def chapters() -> list[Path]:
    chosen = os.environ.get("MINIPAR_BROWSER_NOTEBOOKS")
    if chosen:
        return [(ROOT / p).resolve() for p in chosen.split(",") if p]  # relative to the root, or absolute
    return notebooks_with_widgets()


@pytest.fixture(scope="module")
def lab_page():
    if os.environ.get("MINIPAR_SKIP_BROWSER") == "1":
        pytest.skip("MINIPAR_SKIP_BROWSER=1")
    chromium = find_chromium()
    try:
        import playwright  # noqa: F401
    except ImportError:
        chromium = None
    if chromium is None:
        pytest.fail(how_to_set_up(), pytrace=False)
    course = [ROOT / "notebooks", ROOT / "figures"] + [p for p in chapters() if ROOT not in p.parents]
    with jupyterlab(course) as (base, token, root), browser(chromium) as page:
        yield page, base, token


def test_the_browser_can_show_chinese():
    """The glossaries and seed quotes are in Chinese: without a CJK font the screenshots show empty boxes."""
    if os.environ.get("MINIPAR_SKIP_BROWSER") == "1":
        pytest.skip("MINIPAR_SKIP_BROWSER=1")
    assert chinese_fonts(), how_to_set_up()


def test_there_are_widgets_to_test():
    """The chapters whose sliders the course promises: a widget moved into a helper without the ``widget`` tag
    would drop out of this test silently."""
    assert {p.name for p in notebooks_with_widgets()} >= {"04_pipeline_parallelism.ipynb",
                                                          "07_multidimensional_tensor_parallelism.ipynb",
                                                          "12b_the_planners_toolbox.ipynb"}


@pytest.mark.parametrize("notebook", chapters(), ids=lambda p: p.stem)
def test_chapter_in_jupyterlab(lab_page, notebook):
    page, base, token = lab_page
    run = run_chapter(page, base, token, course_path(notebook).as_posix(), ARTIFACTS)
    errors = "\n".join(run.errors())
    assert not errors, f"{notebook.name}: cells with errors (screenshots in {ARTIFACTS}):\n{errors}"
    assert run.widget_cells, f"{notebook.name}: no widget was rendered"
    for index, view in run.first_views.items():
        shown = view["text"]
        assert not ERROR_TEXT.search(shown), f"{notebook.name} cell {index}: the widget first shows an error:\n{shown}"
        assert view["images"] or re.search(r"\d", shown), \
            f"{notebook.name} cell {index}: the widget's first view shows neither a picture nor a number"
    assert run.moves, f"{notebook.name}: no slider to move"
    unchanged = [f"cell {m.cell} slider {m.label!r}" for m in run.moves if not m.changed]
    assert unchanged == [], f"{notebook.name}: moving these sliders changed nothing on screen: {unchanged}"

"""The course site (tools/site.py): every chapter page exists, shows its outputs and figures, no errors.

Building it executes every chapter (a few minutes on two cores). `make site` builds build/site once; with
MINIPAR_SITE_DIR=build/site this test checks that build instead of making its own.
"""
import html
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("minipar_site", ROOT / "tools" / "site.py")
site = importlib.util.module_from_spec(_spec)
sys.modules["minipar_site"] = site  # the build's worker processes find its functions by this name
_spec.loader.exec_module(site)
syllabus = site.syllabus


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    given = os.environ.get("MINIPAR_SITE_DIR")
    if given:
        out = Path(given)
        assert (out / "manifest.json").exists(), f"MINIPAR_SITE_DIR={given}: no site there (run `make site`)"
    else:
        out = tmp_path_factory.mktemp("site")
        site.build(out, site.chapters(ROOT), jobs=2)
    return out, json.loads((out / "manifest.json").read_text(encoding="utf-8"))


def test_the_site_has_every_chapter(built):
    out, manifest = built
    selected = manifest.get("selected", [p.stem for p in site.chapters(ROOT)])   # a `-k` build: its chapters
    assert set(selected) <= {p.stem for p in site.chapters(ROOT)}, "stale chapters"
    assert sorted(manifest["chapters"]) == sorted(selected), "missing chapters"


@pytest.mark.parametrize("stem", [p.stem for p in site.chapters(ROOT)])
def test_chapter_page_has_its_outputs_and_figures_and_no_errors(built, stem):
    out, manifest = built
    if stem not in manifest.get("selected", [stem]):
        pytest.skip(f"{stem}: not built in this site (tools/site.py -k)")
    assert stem in manifest["chapters"], f"{stem}: not in the site"
    info = manifest["chapters"][stem]
    page = (out / "notebooks" / f"{stem}.html").read_text(encoding="utf-8")
    assert info["errors"] == [], f"{stem}: {info['errors']}"
    assert info["unexecuted"] == 0, f"{stem}: {info['unexecuted']} code cells did not run"
    assert info["outputs"] > 0 and page.count("jp-OutputArea-output") >= info["outputs"] // 2, stem
    assert "Traceback (most recent call last)" not in page, f"{stem}: a traceback on the page"
    assert html.escape(info["title"].split("·")[-1].strip(), quote=False)[:30] in page, f"{stem}: no title"
    for figure in info["figures"]:                      # figures/ pictures the chapter's text shows
        assert (ROOT / "figures" / figure).exists(), f"{stem}: ../figures/{figure} does not exist"
    for src in re.findall(r"<img[^>]*\ssrc=\"([^\"]+)\"", page):  # embedded, or a file of the site
        assert src.startswith("data:image/") or (out / "notebooks" / src).resolve().exists(), f"{stem}: {src}"
    assert page.count("data:image/") >= info["images"] + len(info["figures"]), f"{stem}: pictures missing"


def test_index_glossary_and_figures_pages(built):
    out, manifest = built
    index = (out / "index.html").read_text(encoding="utf-8")
    for stem in manifest["chapters"]:
        assert f"notebooks/{stem}.html" in index
    glossary = (out / "glossary.html").read_text(encoding="utf-8")
    with_glossary = [s for s, info in manifest["chapters"].items() if info["glossary"]]
    assert with_glossary, "no chapter has a glossary table"
    for stem in with_glossary:
        en, zh = manifest["chapters"][stem]["glossary"][0]
        assert html.escape(zh) in glossary and f"notebooks/{stem}.html" in glossary
    figures = (out / "figures.html").read_text(encoding="utf-8")
    for name in manifest["figures"]:
        assert f"figures/{name}" in figures and (out / "figures" / name).exists()


def test_every_relative_link_on_a_chapter_page_resolves_inside_the_site(built):
    """A link from a chapter to another chapter, a figure or its exercise notebook leads to a file the site has
    (the exercises/ and solutions/ notebooks are copied beside the pages for that)."""
    out, manifest = built
    broken = []
    for stem in manifest["chapters"]:
        page = (out / "notebooks" / f"{stem}.html").read_text(encoding="utf-8")
        for href in re.findall(r'href=["\']([^"\'#?]+)', page):
            if re.match(r"[a-z]+:", href) or href.startswith("/"):
                continue                                # http(s), mailto, data: not this site's files
            if not (out / "notebooks" / html.unescape(href)).resolve().exists():
                broken.append(f"{stem}: {href}")
    assert not broken, "\n".join(sorted(set(broken)))


def test_the_chapter_map_has_every_chapter_from_the_syllabus_and_the_doc_pages(built):
    out, manifest = built
    index = (out / "index.html").read_text(encoding="utf-8")
    rows = re.findall(r"<tr><td>([^<]+)</td><td><a href='notebooks/([^']+)\.html'>([^<]*)</a></td>"
                      r"<td>([^<]*)</td><td>([^<]*)</td><td>(\d+) min</td><td>(\d+) s", index)
    assert [r[1] for r in rows] == [p.stem for p in site.chapters(ROOT)], "a chapter missing from the map"
    for number, stem, title, summary, route, minutes, seconds in rows:
        a = syllabus.about(number)
        assert (html.unescape(title), html.unescape(summary), route, int(minutes), int(seconds)) == \
               (a.title, a.summary, a.route, a.minutes, a.run_seconds), stem
    for page in ("cli", "library"):
        assert f"href='{page}.html'" in index and "python -m minipar" in (out / f"{page}.html").read_text("utf-8")
    glossary = (out / "glossary.html").read_text(encoding="utf-8")
    assert all(html.escape(zh) in glossary for _, zh, _ in site.doc_glossary()), "a docs/glossary.md term missing"


@pytest.mark.parametrize("stem", [p.stem for p in site.chapters(ROOT)])
def test_each_chapter_runs_within_a_fifth_of_its_stated_seconds(built, stem):
    """The seconds a chapter's opening states (the syllabus's) against this build's, one chapter at a time on
    two cores as ``make site`` runs them, after dividing by this machine's speed (``syllabus.machine_speed``: the
    build's median built / stated seconds; a machine twice as fast runs every chapter in about half): a fifth, or
    2 s for the shortest (a kernel's start jitters by about a second). A build of several kernels at once shares
    the cores and says nothing."""
    out, manifest = built
    if stem not in manifest["chapters"]:
        pytest.skip(f"{stem}: not built here")
    if manifest.get("kernels_at_once", 1) != 1:
        pytest.skip(f"{manifest['kernels_at_once']} chapters ran at once: their seconds are not a learner's")
    if not manifest.get("alone", True):
        pytest.skip("the build shared the cores with the tests (make test): `make site` measures a learner's seconds")
    if manifest.get("one_kernel"):
        pytest.skip("the chapters shared one kernel: their seconds leave out a kernel's start, a learner's do not")
    speed = syllabus.machine_speed({s.split("_")[0]: c["seconds"] for s, c in manifest["chapters"].items()})
    stated, took = syllabus.about(stem.split("_")[0]).run_seconds, manifest["chapters"][stem]["seconds"]
    here = took / (speed or 1.0)
    assert abs(here - stated) <= max(0.2 * stated, 2.0), (
        f"{stem}: took {took} s" + (f" ({here:.1f} s at the syllabus's speed: this machine ran the "
                                     f"{len(manifest['chapters'])} chapters in {speed:.2f} × their stated seconds, "
                                     "the median)" if speed else "")
        + f"; states ~{stated} s: set run_seconds in minipar/course/syllabus.py, then "
        "`python tools/syllabus.py --notebooks`")


def test_machine_speed_is_the_median_over_enough_chapters():
    """The speed the seconds are divided by: the median of built / stated over at least SPEED_CHAPTERS chapters
    (an even count: the mean of the middle two), None below that; chapters not built or unknown count for nothing."""
    stated = {n: a.run_seconds for n, a in syllabus.ABOUT.items()}
    numbers = list(stated)[:syllabus.SPEED_CHAPTERS + 1]              # an odd count
    halved = {n: stated[n] / 2 for n in numbers}
    assert syllabus.machine_speed(halved) == pytest.approx(0.5)
    one_slow = dict(halved, **{numbers[0]: stated[numbers[0]] * 5})   # one chapter far off moves nothing
    assert syllabus.machine_speed(one_slow) == pytest.approx(0.5)
    ratios = [0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1]                  # an even count
    even = {n: r * stated[n] for n, r in zip(numbers, ratios)}
    assert syllabus.machine_speed(even) == pytest.approx(0.75)
    assert syllabus.machine_speed(dict(list(halved.items())[:syllabus.SPEED_CHAPTERS - 1])) is None
    assert syllabus.machine_speed(dict(halved, **{numbers[0]: None}, nope=3.0)) == pytest.approx(0.5)


def _widget_notebook(shown_text):
    """A notebook whose one cell displayed a VBox holding an Output widget that shows ``shown_text``."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("display(controls, out)")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        site.WIDGET_VIEW: {"model_id": "box", "version_major": 2, "version_minor": 0},
        "text/plain": "VBox(...)"})]
    nb.cells = [cell]
    nb.metadata["widgets"] = {site.WIDGET_STATE: {"state": {
        "box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_out"]}},
        "out": {"model_name": "OutputModel", "state": {"outputs": [
            {"output_type": "stream", "name": "stdout", "text": shown_text}]}}}}}
    return nb


def test_a_widget_is_shown_by_its_first_view():
    nb = _widget_notebook("bubble 27.3%\n")
    assert site.freeze_widgets(nb) == (1, [])
    texts = [o.get("text", "") for o in nb.cells[0].outputs]
    assert "bubble 27.3%\n" in texts and "widgets" not in nb.metadata


def test_a_widget_whose_first_view_is_an_error_fails_the_build():
    frozen, errors = site.freeze_widgets(_widget_notebook("ValueError: 1f1b needs at least as many micro-batches"))
    assert frozen == 1 and len(errors) == 1 and "first view is an error" in errors[0]


def test_a_kernel_that_does_not_answer_is_tried_once_more(monkeypatch, tmp_path):
    import notebook_client
    path = tmp_path / "c.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]), path)
    calls = []

    def execute(self, **_):                    # the first kernel does not start, the second runs
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Kernel didn't respond in 60 seconds")
        return self.nb
    monkeypatch.setattr(notebook_client.SlicedClient, "execute", execute)
    nb = site.execute(path, timeout=5)
    assert len(calls) == 2 and nb.metadata["minipar_tries"] == 2


def test_a_chapter_that_cannot_run_is_named_and_the_others_still_built(monkeypatch, tmp_path):
    def execute(path, timeout, threads, shared=None):
        raise RuntimeError("Kernel didn't respond in 300 seconds")
    monkeypatch.setattr(site, "execute", execute)
    stem, info, page = site._build_one((tmp_path / "07_x.ipynb", 5, None, None))
    assert stem == "07_x" and info["errors"] == ["not built: RuntimeError: Kernel didn't respond in 300 seconds"]
    assert "not built" in page and set(info) >= {"outputs", "images", "figures", "title", "glossary"}


def test_glossary_rows_are_read_from_the_chapter():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("## Glossary\n\n| English | 中文 |\n|---|---|\n| rank | 进程编号 |\n")]
    assert site.glossary(nb) == [("rank", "进程编号")]


def _nav_links(page: str) -> dict:
    """{'prev'/'next': the href in that span, 'chapters': [hrefs in the chapter list]} of a page's first nav."""
    nav = re.search(r"<nav class='minipar-nav'.*?</nav>", page, re.S).group(0)
    found = {k: re.findall(rf"<span class='minipar-{k}'>[^<]*<a href='([^']+)'", nav) for k in ("prev", "next")}
    found["chapters"] = re.findall(r"<a href='([^']+)'", nav.split("minipar-chapters", 1)[1])
    found["bold"] = re.findall(r"<span class='minipar-chapter'>[^<]*<b>", nav)
    return found


def test_every_page_has_previous_next_and_the_chapter_list(built):
    out, manifest = built
    course = [stem for stem, _ in site.course_chapters(ROOT)]
    for stem in manifest["chapters"]:
        page = (out / "notebooks" / f"{stem}.html").read_text(encoding="utf-8")
        assert page.count("class='minipar-nav") == 2, f"{stem}: navigation at the top and the bottom"
        nav, i = _nav_links(page), course.index(stem)
        assert nav["prev"] == ([f"../notebooks/{course[i - 1]}.html"] if i else []), stem
        assert nav["next"] == ([f"../notebooks/{course[i + 1]}.html"] if i + 1 < len(course) else []), stem
        assert nav["chapters"] == [f"../notebooks/{s}.html" for s in course if s != stem] and len(nav["bold"]) == 1
        for href in nav["chapters"]:            # a chapter in this build is a page of it
            target = (out / "notebooks" / href).resolve()
            assert target.stem not in manifest["chapters"] or target.exists(), f"{stem}: {href}"
    for name in ("index.html", "glossary.html", "figures.html"):
        nav = _nav_links((out / name).read_text(encoding="utf-8"))
        assert nav["chapters"] == [f"notebooks/{s}.html" for s in course] and not nav["prev"], name


def test_the_navigation_links_neighbours_and_marks_the_current_chapter():
    chapters = [("00_a", "00 · A"), ("01_b", "01 · B"), ("02_c", "02 · C")]
    middle, first, last = (_nav_links(site.chapter_nav(chapters, c, "../") + "")
                           for c in ("01_b", "00_a", "02_c"))
    assert middle["prev"] == ["../notebooks/00_a.html"] and middle["next"] == ["../notebooks/02_c.html"]
    assert first["prev"] == [] and first["next"] == ["../notebooks/01_b.html"]
    assert last["next"] == [] and last["prev"] == ["../notebooks/01_b.html"]
    assert middle["chapters"] == ["../notebooks/00_a.html", "../notebooks/02_c.html"] and len(middle["bold"]) == 1
    assert "<b>B</b>" in site.chapter_nav(chapters, "01_b") and "minipar-prev" not in site.chapter_nav(chapters)


def test_a_number_printed_before_its_reveal_is_a_leak():
    nb = nbformat.v4.new_notebook()
    predict = nbformat.v4.new_code_cell("# Predict first: how many bytes?\nmy_guess = None")
    run = nbformat.v4.new_code_cell("print(sent)")
    run.outputs = [nbformat.v4.new_output("stream", name="stdout", text="rank 0 sent 12288 B\n")]
    shown = nbformat.v4.new_code_cell("reveal(my_guess, sent, what='bytes')")
    shown.outputs = [nbformat.v4.new_output("stream", name="stdout", text="bytes: measured 12,288 B  ->  ...\n")]
    nb.cells = [predict, run, shown]
    assert site.predict_leaks(nb) == ["cell 1 prints ['12,288'] before my_guess is revealed in cell 2"]
    nb.cells = [predict, shown, run]
    assert site.predict_leaks(nb) == []


@pytest.mark.parametrize("stem", [p.stem for p in site.chapters(ROOT)])
def test_no_chapter_prints_an_answer_before_the_guess_is_revealed(built, stem):
    out, manifest = built
    if stem not in manifest["chapters"]:
        pytest.skip(f"{stem}: not built here")
    assert manifest["chapters"][stem].get("predict_leaks", []) == [], stem

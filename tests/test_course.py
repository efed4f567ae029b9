"""The course's shape and its runners.

* One chapter, one name: ``notebooks/NN_topic.ipynb``, ``minipar/course/chNN_topic/``, and where they exist
  ``solutions/NN_topic.ipynb``, ``exercises/NN_topic.ipynb`` and figures ``NN_*.png``.
* The figure generator: every registered figure (a chapter's ``figures.py`` ``FIGURES``) is made by
  ``minipar.course.figures.generate`` into a temporary folder and is a non-empty PNG. One test per figure, so
  a slow or broken chapter is named; the committed ``figures/`` holds a PNG for every registered figure.
* One source for what each chapter is (``minipar/course/syllabus.py``): the README's chapter table and routes,
  each chapter's opening and ``docs/cli.md``'s flag table agree with it (or with the train command's parser).
"""
import functools
import json

import pytest

from minipar.course import ROOT, chapters, collect, figures, syllabus
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


def _fewer_runs(monkeypatch, request=None) -> dict:
    """Some pictures are drawn from minutes of real runs (all tour rows; chapter 08's layouts on 8 ranks; the
    schedules paced; 10b's recipes over three seeds; chapter 00's all-reduce on up to 8 ranks; chapter 03's
    8-block GPT under four ZeRO stages). Here they are drawn from fewer or smaller of those runs: what each run
    measures is checked where it is made (each tour row in its chapter's tests, 08's layouts in its report, the
    paced schedules in chapter 04's tests, the recipes in 10b's, ring vs root traffic per N in chapter 00's
    test_ring_vs_root_traffic, the ZeRO stages' memory in chapter 03's and tests/test_zero.py); this test
    checks that the generator draws and writes. `python -m minipar figures` draws them from every run.
    {figure: what cuts its runs}. Appendix A's two rows are ones chapters 03 and 04 check, taken from the
    session's runs (conftest.tour_row)."""
    from minipar.check import gpt_recipe
    from minipar.course.ch00_setup_and_collectives import figures as ch00
    from minipar.course.ch03_zero_and_fsdp import figures as ch03
    from minipar.course.ch04_pipeline_parallelism import figures as ch04
    from minipar.course.ch08_hybrid_parallelism import measure as ch08
    from minipar.course.ch09_mixture_of_experts import figures as ch09
    from minipar.course.ch10b_fp8 import training as ch10b
    from minipar.course.chA_how_minipar_measures import bench as chA
    from minipar.course.hybrid_runs import recipe
    first = lambda d, n: dict(list(d.items())[:n])                      # noqa: E731

    def tour_rows_shared():
        monkeypatch.setattr(chA, "TOUR_LAYOUTS", {k: chA.TOUR_LAYOUTS[k] for k in A_ROWS})
        monkeypatch.setattr(chA, "compare_with_tour", functools.partial(
            chA.compare_with_tour, run_row=request.getfixturevalue("tour_row")))

    def two_steps_two_schedules():
        # 2 steps, not 4: typical_step draws a step after the first, and with 2 there is one
        monkeypatch.setattr(ch04, "timeline_recipe", functools.partial(ch04.timeline_recipe, steps=2))
        monkeypatch.setattr(ch04, "run_timelines", functools.partial(ch04.run_timelines, shown=ch04.SHOWN[1:3]))
    return {
        "A_predicted_vs_measured.png": tour_rows_shared,
        # one layout's 8-rank run draws the bars as well as seven (each ~5 CPU-s)
        "08_memory_per_layout.png": lambda: monkeypatch.setattr(ch08, "LAYOUTS", first(ch08.LAYOUTS, 1)),
        "04_measured_timelines.png": two_steps_two_schedules,
        **{name: lambda: monkeypatch.setattr(
            ch09, "_balance_runs", functools.partial(_short_balance_runs, ch09._balance_runs))
           for name in ("09_balance.png", "09_capacity.png", "09_loss_free.png")},
        # 2 steps, not 3: typical_step draws a step after the first (the first also allocates)
        "08_step_timeline.png": lambda: monkeypatch.setattr(ch08, "recipe", lambda steps=3: recipe(min(steps, 2))),
        # N = 2 and 4, not 2..8: the 6- and 8-rank launches were most of the figure's CPU
        "00_ring_vs_root.png": lambda: monkeypatch.setattr(
            ch00, "traffic_sweep", functools.partial(ch00.traffic_sweep, sizes=(2, 4))),
        # the same stages, steps and recipe on 2 blocks, not 8 (8 only make ZeRO-3's peak fall below ZeRO-2's,
        # a property of the picture this test does not look at)
        "03_zero_memory.png": lambda: monkeypatch.setattr(
            ch03, "memory_recipe", lambda batch_size=8: gpt_recipe(
                steps=2, batch_size=batch_size, seq_len=8, optimizer="adam", n_embd=32, n_layer=2)),
        "10b_training_curves.png": lambda: monkeypatch.setattr(
            ch10b, "run_study", functools.partial(ch10b.run_study, seeds=ch10b.SEEDS[:2])),
    }


@functools.lru_cache(maxsize=1)
def _short_balance_runs(balance_runs) -> dict:
    """Chapter 09's three balance runs (its figures' ``balance_runs``, shared by three figures) at 10 Adam steps,
    not 60: a curve over training is drawn from 10 steps as from 60; the balancing itself is checked in chapter
    09's tests. Cached like the original, so the three figures share one set of runs."""
    from minipar.course.ch09_mixture_of_experts import figures as ch09
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ch09, "balance_run", functools.partial(ch09.balance_run, steps=10))
        return balance_runs.__wrapped__()


def test_the_figures_drawn_from_fewer_runs_are_registered():
    """A renamed figure would silently be drawn from every run again (minutes): the names must be current."""
    assert set(_fewer_runs(None)) <= set(NAMES), set(_fewer_runs(None)) - set(NAMES)


A_ROWS = ("ZeRO-1 ring", "pipeline 1F1B")           # tour rows chapters 03 and 04 (and appendix A) check


@pytest.mark.parametrize("name", NAMES)
def test_generator_writes_a_nonempty_png(name, tmp_path, monkeypatch, request):
    _fewer_runs(monkeypatch, request).get(name, lambda: None)()
    written = figures.generate(str(tmp_path), select=name)
    path = tmp_path / name
    assert str(path) in written and path.exists(), name
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, f"{name}: {len(data)} bytes, not a PNG picture"


def test_every_registered_figure_is_committed_in_figures_folder():
    missing = [n for n in NAMES if not (ROOT / "figures" / n).exists()]
    assert not missing, f"run `python -m minipar figures` and commit: {missing}"


# One source for what each chapter is (minipar/course/syllabus.py): the README's chapter table and routes are
# written from it by tools/syllabus.py, each chapter's opening states the same title, minutes and seconds.

def test_every_chapter_has_one_syllabus_entry():
    assert [c.number for c in chapters()] == list(syllabus.ABOUT), "one entry per chapter, in chapter order"
    for number, a in syllabus.ABOUT.items():
        assert a.title and a.summary and "\n" not in a.summary and len(a.summary) <= 100, number
        assert a.minutes > 0 and a.run_seconds > 0, number
        assert bool(a.core_sections) == bool(a.core_minutes and a.elective_minutes), number


def test_readme_chapter_table_and_routes_are_written_from_the_syllabus():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stems = {c.number: c.name for c in chapters()}
    assert syllabus.with_readme_tables(readme, stems) == readme, "README is stale: run `python tools/syllabus.py`"
    core, elective = syllabus.route_minutes()
    assert core + elective == sum(a.minutes for a in syllabus.ABOUT.values())
    assert f"about {syllabus.hours(core)}" in readme and f"about {syllabus.hours(elective)} in all" in readme


def test_a_stale_readme_or_opening_is_named():
    stems = {c.number: c.name for c in chapters()}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    seconds = chapters()[0].about.run_seconds
    stale = readme.replace(f"| {seconds} s |", f"| {seconds + 3} s |", 1)
    assert stale != readme and syllabus.with_readme_tables(stale, stems) == readme
    chapter = chapters()[0]
    opening = "".join(json.loads(chapter.notebook.read_text(encoding="utf-8"))["cells"][0]["source"])
    wrong = opening.replace(f"about {chapter.about.run_seconds} s", f"about {chapter.about.run_seconds + 7} s")
    assert wrong != opening and syllabus.opening_problems(chapter.number, wrong) != []
    assert syllabus.with_time_sentence(wrong, chapter.about) == opening


@pytest.mark.parametrize("chapter", chapters(), ids=lambda c: c.name)
def test_chapter_opening_states_the_syllabus_title_minutes_and_seconds(chapter):
    opening = "".join(json.loads(chapter.notebook.read_text(encoding="utf-8"))["cells"][0]["source"])
    assert syllabus.opening_problems(chapter.number, opening) == [], "run `python tools/syllabus.py --notebooks`"


def test_readme_is_one_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README: {len(lines)} lines"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 120 and not line.startswith("|")]
    assert not long, f"README lines {long}: more than 120 characters (a table row is one chapter; prose wraps)"
    for page in ("docs/cli.md", "docs/library.md", "docs/glossary.md", "CONTRIBUTING.md"):
        assert f"({page})" in "\n".join(lines) and (ROOT / page).exists(), page


def _documented_train_flags() -> dict:
    """{flag: default as docs/cli.md shows it} from its train table (rows "| `--flag ...` | default | ... |")."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    table = text.split("## `python -m minipar train`", 1)[1].split("\n## ", 1)[0]
    rows = [[p.strip() for p in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| `--")]
    return {row[0].strip("`").split()[0]: (row[1].strip("`"), row[2]) for row in rows}


def test_docs_cli_lists_every_train_flag_with_its_default():
    import argparse
    from minipar.hybrid.cli import build_parser
    documented = _documented_train_flags()
    actions = [a for a in build_parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert sorted(documented) == sorted(a.option_strings[0] for a in actions)
    for a in actions:
        shown, what = documented[a.option_strings[0]]
        default = a.default
        if default is None and a.help and "(default " in a.help:   # set after parsing (--keep: only with --save)
            default = a.help.split("(default ", 1)[1].split(";")[0].split(")")[0].split(":")[0].strip()
        want = "off" if a.nargs == 0 else "—" if default is None else (
            f"{default:g}" if isinstance(default, float) else str(default))
        assert shown == want, (a.option_strings[0], shown, want)
        for choice in a.choices or ():
            assert f"`{choice}`" in what or shown == str(choice), (a.option_strings[0], choice)

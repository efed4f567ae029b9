"""Write ``exercises/`` from ``solutions/``: one source for both, so they never drift apart.

    python -m minipar exercises           # (re)write exercises/*.ipynb
    python -m minipar exercises --check   # exit 1 if exercises/ is not what solutions/ generates

A solution notebook ``solutions/NN_topic.ipynb`` (the chapter's name, see :mod:`minipar.course`) marks what the learner writes with nbgrader's
convention, inside a function body (a check cell calls that function)::

    def ring_all_reduce(t, group=None):
        \"\"\"...\"\"\"
        ### BEGIN SOLUTION
        ...the answer...
        ### END SOLUTION

The exercise version of each code cell keeps everything outside the markers and replaces each region by
``# YOUR CODE HERE`` and ``raise NotImplementedError()`` at the region's indentation. A region in a markdown
cell (a written answer) becomes ``YOUR ANSWER HERE``. Cells tagged ``check`` (they call
the chapter's ``minipar.course.chNN_topic.checks``) also get the ``raises-exception`` tag, so "Run All" and nbval go on past them while
they fail on the stubs. Outputs and execution counts are dropped, and a note on top says where the
solutions are. The output depends on the input only (same bytes every time).

Rules, enforced with a ValueError naming the notebook and cell: markers come in BEGIN/END pairs, are not
nested, sit on lines of their own, and a code region is indented (inside a function): a stub at the top
level of a cell would make the cell raise where no check is expected to.
"""
from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

__all__ = ["BEGIN", "END", "CHECK_TAG", "RAISES_TAG", "stub_source", "make_exercise", "render",
           "generate", "stale", "main"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CHECK_TAG, RAISES_TAG = "check", "raises-exception"
NOTE_ID = "exercise-note"
from . import ROOT

_MARKER = re.compile(r"^(?P<indent>[ \t]*)(?P<marker>### (?:BEGIN|END) SOLUTION)[ \t]*$")

NOTE = ("> **This is the exercise version** of `solutions/{name}`: fill in each `# YOUR CODE HERE` "
        "(remove the `raise NotImplementedError()`), then run the cell below it tagged `check` — it "
        "tells you what it expected, what it got and the likely mistake. \"Run All\" goes on past "
        "failing checks. The solutions are in [`../solutions/{name}`](../solutions/{name}).")


def stub_source(source: str, where: str = "", cell_type: str = "code") -> str:
    """Replace every BEGIN/END SOLUTION region of one cell's source by a stub (see the module docstring)."""
    out, inside, indent = [], False, ""
    for lineno, line in enumerate(source.split("\n"), 1):
        m = _MARKER.match(line)
        if m is None:
            if BEGIN in line or END in line:
                raise ValueError(f"{where} line {lineno}: a solution marker must be alone on its line: {line!r}")
            if not inside:
                out.append(line)
            continue
        if m["marker"] == BEGIN:
            if inside:
                raise ValueError(f"{where} line {lineno}: {BEGIN} inside another region (nested or no END)")
            inside, indent = True, m["indent"]
            if cell_type == "code" and not indent:
                raise ValueError(f"{where} line {lineno}: a code solution region must be inside a function "
                                 f"body (indented); the check cell calls the function")
        else:
            if not inside:
                raise ValueError(f"{where} line {lineno}: {END} without a {BEGIN}")
            inside = False
            out += ([f"{indent}# YOUR CODE HERE", f"{indent}raise NotImplementedError()"]
                    if cell_type == "code" else [f"{indent}YOUR ANSWER HERE"])
    if inside:
        raise ValueError(f"{where}: {BEGIN} without an {END}")
    return "\n".join(out)


def count_regions(source: str) -> int:
    return sum(1 for line in source.split("\n") if (m := _MARKER.match(line)) and m["marker"] == BEGIN)


def make_exercise(solution, name: str):
    """The exercise notebook (an nbformat node) for the solution notebook ``solution`` named ``name``."""
    import nbformat
    nb = copy.deepcopy(solution)
    for i, cell in enumerate(nb.cells):
        where = f"solutions/{name} cell {i}"
        cell.source = stub_source(cell.source, where, cell.cell_type)
        cell.metadata.pop("execution", None)        # timings: would make the output differ run to run
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            tags = list(cell.metadata.get("tags", []))
            if CHECK_TAG in tags and RAISES_TAG not in tags:
                cell.metadata["tags"] = tags + [RAISES_TAG]
    note = nbformat.v4.new_markdown_cell(NOTE.format(name=name))
    note.id = NOTE_ID
    nb.cells.insert(0, note)
    nb.metadata.pop("widgets", None)
    return nb


def render(nb) -> str:
    import nbformat
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def _pairs(solutions: Path, exercises: Path):
    for path in sorted(solutions.glob("*.ipynb")):
        yield path, exercises / path.name


def expected_exercises(solutions: Path = ROOT / "solutions", exercises: Path = ROOT / "exercises") -> dict:
    """{exercise path: the text it must have}, generated in memory."""
    import nbformat
    out = {}
    for src, dst in _pairs(Path(solutions), Path(exercises)):
        nb = nbformat.read(src, as_version=4)
        out[dst] = render(make_exercise(nb, src.name))
    return out


def stale(solutions: Path = ROOT / "solutions", exercises: Path = ROOT / "exercises") -> list:
    """Exercise files that differ from what the solutions generate, are missing, or have no solution."""
    want = expected_exercises(solutions, exercises)
    bad = [str(p) for p, text in want.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    orphans = [str(p) for p in sorted(Path(exercises).glob("*.ipynb")) if p not in want]
    return bad + [f"{p} (no solution notebook)" for p in orphans]


def generate(solutions: Path = ROOT / "solutions", exercises: Path = ROOT / "exercises") -> list:
    """Write every exercise notebook that differs; return the paths written."""
    written = []
    Path(exercises).mkdir(parents=True, exist_ok=True)
    for path, text in expected_exercises(solutions, exercises).items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(str(path))
    return written


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m minipar exercises", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if exercises/ is out of date")
    parser.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    parser.add_argument("--exercises", type=Path, default=ROOT / "exercises")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.solutions, args.exercises)
        for p in bad:
            print(f"out of date: {p}", file=sys.stderr)
        if bad:
            print("run: python -m minipar exercises", file=sys.stderr)
        return 1 if bad else 0
    for p in generate(args.solutions, args.exercises):
        print(f"wrote {p}")
    return 0

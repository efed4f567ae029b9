"""Write what minipar/course/syllabus.py says about the chapters where the learner reads it.

    python tools/syllabus.py               # the README's routes and chapter table (between its markers)
    python tools/syllabus.py --notebooks   # and each chapter's **Time.** sentence (its first cell only)
    python tools/syllabus.py --estimate    # minutes to read as estimated: words / 200 + 5 per exercise stub

After a site build has measured new seconds (build/site/manifest.json), change ``run_seconds`` in the syllabus
and run this with ``--notebooks``. tests/test_course.py fails while the README or an opening is stale.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # this checkout's minipar, also when another one is installed

from minipar.course import chapters  # noqa: E402
from minipar.course.syllabus import with_readme_tables, with_time_sentence  # noqa: E402


def stems() -> dict:
    return {c.number: c.name for c in chapters()}


def write_readme(path: Path = ROOT / "README.md") -> bool:
    text = path.read_text(encoding="utf-8")
    new = with_readme_tables(text, stems())
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def write_opening(path: Path, about) -> bool:
    """Rewrite the **Time.** sentence of the notebook's first cell, keeping the file's JSON layout (indent 1,
    UTF-8 as is, a final newline) so that the diff is that sentence."""
    raw = path.read_text(encoding="utf-8")
    nb = json.loads(raw)
    cell = nb["cells"][0]
    old = "".join(cell["source"])
    new = with_time_sentence(old, about)
    if new == old:
        return False
    cell["source"] = new.splitlines(keepends=True)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return True


def estimate(chapter) -> tuple[int, int]:
    """(markdown words of the chapter, exercise stubs in its exercise notebook)."""
    cells = json.loads(chapter.notebook.read_text(encoding="utf-8"))["cells"]
    words = sum(len(re.findall(r"\S+", "".join(c["source"]))) for c in cells if c["cell_type"] == "markdown")
    stubs = 0
    if chapter.exercise.exists():
        stubs = sum("YOUR CODE HERE" in "".join(c["source"])
                    for c in json.loads(chapter.exercise.read_text(encoding="utf-8"))["cells"])
    return words, stubs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--notebooks", action="store_true", help="also each chapter's Time sentence")
    ap.add_argument("--estimate", action="store_true", help="print the minutes-to-read estimate and stop")
    args = ap.parse_args(argv)
    if args.estimate:
        for c in chapters():
            words, stubs = estimate(c)
            guess = 5 * round((words / 200 + 5 * stubs) / 5)
            print(f"{c.number:>4}: {words:5d} words ({words / 200:4.1f} min) + {stubs} stubs x 5 min "
                  f"= ~{guess} min; the syllabus says {c.about.minutes}")
        return 0
    print("README.md: " + ("written" if write_readme() else "already current"))
    if args.notebooks:
        for c in chapters():
            if write_opening(c.notebook, c.about):
                print(f"{c.notebook.name}: Time sentence written")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every chapter makes the learner think (issue 19): it predicts before it measures, and it ends with check
questions whose answers are in the chapter's solution notebook.

* Predict first: a code cell with a ``# Predict first`` comment sets a variable to ``None`` (the learner's
  number goes there), and a later cell passes that variable to :func:`minipar.course.predict.reveal` beside
  the measured value.
* Check questions: the notebook's last cell is ``## Check questions`` with 3 to 5 numbered questions; the
  solution notebook ends with ``## Check questions`` and one cell ``**Qk.** <same text>`` per question, the
  answer inside a solution region (so the exercise notebook asks it with "YOUR ANSWER HERE").
"""
import json
import re
from pathlib import Path

import pytest

from minipar.course import chapters
from minipar.course.exercises import BEGIN, END

CHAPTERS = chapters()
ROOT_DIR = Path(__file__).resolve().parents[1]
QUESTION = re.compile(r"^(\d+)\. (\S.*)$")
SOLVED = re.compile(r"^\*\*Q(\d+)\.\*\* (\S.*)$")
GUESS = re.compile(r"^(\w+) = None\b", re.M)


def _cells(path):
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(path.read_text())["cells"]]


def questions_of(path) -> list:
    kind, text = _cells(path)[-1]
    assert kind == "markdown" and text.startswith("## Check questions"), \
        f"{path.name}: the last cell is not '## Check questions'"
    found = [QUESTION.match(line) for line in text.splitlines()]
    found = [m for m in found if m]
    assert [int(m.group(1)) for m in found] == list(range(1, len(found) + 1)), f"{path.name}: numbering"
    assert 3 <= len(found) <= 5, f"{path.name}: {len(found)} check questions, want 3 to 5"
    assert f"solutions/{path.stem}.ipynb" in text, f"{path.name}: say where the answers are"
    return [m.group(2).strip() for m in found]


def answers_of(path) -> list:
    cells = _cells(path)
    heads = [i for i, (k, t) in enumerate(cells) if k == "markdown" and t.strip() == "## Check questions"]
    assert heads, f"{path.name}: no '## Check questions' cell"
    out = []
    for kind, text in cells[heads[-1] + 1:]:
        first, _, rest = text.partition("\n")
        m = SOLVED.match(first)
        assert kind == "markdown" and m, f"{path.name}: after '## Check questions' only **Qk.** cells: {first!r}"
        body = rest.split(BEGIN, 1)[1].split(END, 1)[0].strip() if BEGIN in rest and END in rest else ""
        assert len(body) > 40, f"{path.name} Q{m.group(1)}: the answer is missing or a stub"
        out.append(m.group(2).strip())
    return out


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.name)
def test_chapter_ends_with_check_questions_answered_in_its_solution(chapter):
    asked = questions_of(chapter.notebook)
    assert chapter.solution.exists(), f"{chapter.name}: no solution notebook for the check questions"
    assert answers_of(chapter.solution) == asked, f"{chapter.name}: the solution's questions differ"


def _call_arguments(text: str, name: str) -> str:
    """The source of the arguments of the ``reveal(name, ...)`` call in ``text``."""
    start = re.search(rf"\breveal\(\s*{name}\b", text).end()
    depth, i = 1, start
    while depth and i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1]


def answer_leaks(path) -> list:
    """Where a predict cell's answer shows before its reveal: a markdown cell between the predict cell and the
    cell that reveals (the learner reads on before running: an explanation there gives the answer away), or a
    cell between them that computes the reveal's ``formula=`` expression (its output is the answer)."""
    cells = _cells(path)
    leaks = []
    for i, (kind, text) in enumerate(cells):
        if kind != "code" or "# Predict first" not in text:
            continue
        for name in GUESS.findall(text):
            j = next((j for j in range(i + 1, len(cells)) if cells[j][0] == "code"
                      and re.search(rf"\breveal\(\s*{name}\b", cells[j][1])), None)
            if j is None:
                continue
            formula = re.search(r"formula\s*=\s*(.+?)(?:,\s*\w+\s*=|$)", _call_arguments(cells[j][1], name), re.S)
            expression = " ".join(formula.group(1).split()) if formula else None
            for k in range(i + 1, j):
                if cells[k][0] == "markdown":
                    leaks.append(f"{path.stem} cell {k}: text between the prediction of {name} and its reveal")
                elif expression and len(expression) > 3 and expression in " ".join(cells[k][1].split()):
                    leaks.append(f"{path.stem} cell {k}: computes {expression} (the answer to {name}) before the reveal")
    return leaks


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.name)
def test_no_answer_shows_before_the_learner_guesses(chapter):
    assert answer_leaks(chapter.notebook) == []


def test_an_answer_shown_early_is_caught(tmp_path):
    predict = {"cell_type": "code", "source": "# Predict first: how many?\nmy_guess = None"}
    run = {"cell_type": "code", "source": "n = count(4)\nreveal(my_guess, n, what='n', formula=count(4))"}
    nb = {"cells": [predict, run], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "99_x.ipynb"
    path.write_text(json.dumps(nb))
    assert answer_leaks(path) == []
    told = {"cell_type": "markdown", "source": "It is count(4) = 12."}
    printed = {"cell_type": "code", "source": "print(count(4))"}
    nb["cells"] = [predict, told, printed, run]
    path.write_text(json.dumps(nb))
    assert [leak.split(":")[0] for leak in answer_leaks(path)] == ["99_x cell 1", "99_x cell 2"]


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.name)
def test_chapter_predicts_before_it_measures(chapter):
    cells = [t for k, t in _cells(chapter.notebook) if k == "code"]
    pairs = []
    for i, text in enumerate(cells):
        if "# Predict first" not in text:
            continue
        for name in GUESS.findall(text):
            later = [t for t in cells[i + 1:] if re.search(rf"\breveal\(\s*{name}\b", t)]
            assert later, f"{chapter.name}: {name} is predicted but never revealed"
            pairs.append(name)
    assert pairs, f"{chapter.name}: no '# Predict first' cell with a guess revealed later"


def test_the_parsers_refuse_a_malformed_chapter(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": "## Check questions\n\n1. Why?\n2. How?\n"}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "99_x.ipynb"
    path.write_text(json.dumps(nb))
    with pytest.raises(AssertionError, match="want 3 to 5"):
        questions_of(path)
    nb["cells"] = [{"cell_type": "markdown", "source": "## Check questions"},
                   {"cell_type": "markdown", "source": f"**Q1.** Why?\n\n{BEGIN}\nshort\n{END}"}]
    path.write_text(json.dumps(nb))
    with pytest.raises(AssertionError, match="missing or a stub"):
        answers_of(path)


def _main_term(chinese: str) -> str:
    """The term itself, without the explanation in brackets: 环形全归约 (Ring AllReduce) -> 环形全归约."""
    return re.sub(r"\s*[（(][^）)]*[）)]", "", chinese).strip()


def glossary_terms() -> dict:
    """{english term: {main chinese term: [where]}} over the course glossary (docs/glossary.md) and every
    chapter's."""
    terms: dict = {}
    tables = [("docs/glossary.md", (ROOT_DIR / "docs" / "glossary.md").read_text(encoding="utf-8"))]
    tables += [(c.name, "\n".join(t for k, t in _cells(c.notebook) if k == "markdown" and "## Glossary" in t))
               for c in CHAPTERS]
    for where, text in tables:
        for line in text.split("## Glossary", 1)[-1].splitlines():
            parts = [p.strip() for p in line.strip().strip("|").split("|")]
            if line.startswith("|") and len(parts) >= 2 and not set(parts[0]) <= set("-: ") \
                    and parts[0].lower() != "english":
                terms.setdefault(parts[0].lower(), {}).setdefault(_main_term(parts[1]), []).append(where)
    return terms


def test_one_chinese_term_for_each_glossary_entry():
    """归约散射, not 规约散射 or 归约分发, in every glossary (issue 27)."""
    terms = glossary_terms()
    assert "reduce-scatter" in terms and "ring all-reduce" in terms
    clashes = {en: zh for en, zh in terms.items() if len(zh) > 1}
    assert clashes == {}, clashes

"""No authoring language in front of the learner (issue 42).

A chapter's markdown speaks about distributed training, not about how the course is built. Every markdown cell
of every ``notebooks/*.ipynb`` fails this test, naming the chapter, the cell index and the sentence, when it

* names ``shared/`` or the ``SYLLABUS`` (the course's source articles live outside the repository: cite an
  article by its title and origin, as each chapter's "Sources and corrections" box does);
* names a source article by its file number, a standalone ``000`` … ``004`` (``002's list``, ``003 §7``,
  ``(001: "…")``);
* refers to a source article as a *seed*, i.e. as a file or a numbered document: ``seed 001``, ``Seeds 000, 002``,
  ``seed 003 §8.1``, ``Seed sections``, a ``Seeds.`` / ``Seeds:`` label, ``the seed`` / ``the seeds`` (the
  article(s)), a possessive ``the seed's table`` / ``the seeds' guide``, ``seed says`` (and the other verbs
  only an article does: claims, lists, names, notes, mentions, calls, describes, explains; not "draws"),
  ``seed file(s)``, ``seeds/``;
* names ``CONTRIBUTING``;
* names a test file: a ``tests/`` path or a ``test_*.py`` file;
* names a make target of the ``Makefile`` (``make test``, ``make site``, ``make figures``, ...).

Random-number seeds stay allowed, and the rule is written so that they do: ``random seed``, ``the same seed``,
``a dropout seed``, ``a per-rank seed``, ``seed=0``, ``seed + 100 · pp_rank``, ``seeded``, ``seeding`` and
anything inside inline code (``minipar.debug.seeds``) pass. Write "the random seed", not "the seed", when a
sentence means the generator's seed.
"""
import ast
import json
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _make_targets() -> list:
    """The Makefile's targets (``name:`` at the start of a line, not ``.PHONY`` or a variable)."""
    found = re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M)
    return sorted(set(found) | {"test", "site", "figures", "exercises", "tour", "lab", "clean", "browser"})


INLINE_CODE = re.compile(r"`[^`\n]*`")
# "seed" meaning a source article. Applied with inline code removed, case-insensitive.
SEED_AS_SOURCE = re.compile(r"""
      \bseeds?\s*(?:§\s*)?\d{3}\b                   # numbered: seed 001, Seeds 000, 002, seed 003 §8.1
    | \bseeds?\s+(?:sections?|files?|articles?)\b   # Seed sections, seed files
    | \bseeds?/                                     # seeds/ (a folder)
    | \bseeds?(?:'s|’s|'|’)(?!\w)                   # possessive: the seed's table, the seeds' decision guide
    | (?:^|\*\*)\s*seeds?\s*[.:](?=\*\*|\s|$)     # a "**Seeds.**" / "Seeds:" label
    | \bthe\s+seeds?\b(?!\s*=)                      # the seed says / beyond the seeds (not "the same seed")
    | \bseeds?\s+(?:says?|said|claims?|lists?|names?|notes?|mentions?|calls?|describes?|explains?)\b
""", re.I | re.X | re.M)
ARTICLE_NUMBER = re.compile(r"(?<![\w.,/×-])00[0-4](?![\w.,])")   # 002's list, 003 §7; not 0.001, 1,000, 2004
RULES = [
    ("names shared/ or the SYLLABUS", re.compile(r"\bshared/|\bSYLLABUS\b")),
    ("names a source article by its file number", ARTICLE_NUMBER),
    ("refers to a source article as a seed", SEED_AS_SOURCE),
    ("names CONTRIBUTING", re.compile(r"\bCONTRIBUTING\b")),
    ("names a test file", re.compile(r"(?<![\w.])tests/|\btest_\w+\.py\b")),
    ("names a make target", re.compile(r"\bmake\s+(?:-\S+\s+)*(?:%s)\b" % "|".join(map(re.escape, _make_targets())))),
]


def _sentence(text: str, start: int, end: int) -> str:
    """The sentence (or list item / table row) around text[start:end]."""
    left = max([text.rfind("\n", 0, start) + 1] + [i + 2 for i in (text.rfind(p, 0, start) for p in (". ", "! ", "? "))
                                                  if i >= 0])
    right = [i for i in (text.find("\n", end), *(text.find(p, end) for p in (". ", "! ", "? "))) if i >= 0]
    return " ".join(text[left:min(right) + 1 if right else len(text)].split())


def problems_in(markdown: str) -> list:
    """(rule, sentence) for each authoring-language match in one markdown cell's source."""
    out = []
    for what, rule in RULES:
        text = (INLINE_CODE.sub(lambda m: " " * len(m.group()), markdown) if rule in (SEED_AS_SOURCE, ARTICLE_NUMBER)
                else markdown)
        out += [(what, _sentence(markdown, m.start(), m.end())) for m in rule.finditer(text)]
    return out


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_authoring_language_in_a_chapter(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found = [f"{path.stem} cell {i}: {what}: {sentence}"
             for i, cell in enumerate(cells) if cell["cell_type"] == "markdown"
             for what, sentence in problems_in("".join(cell["source"]))]
    assert not found, "authoring language in front of the learner:\n" + "\n".join(found)


def test_every_chapter_is_checked():
    assert len(CHAPTERS) >= 17 and {"06b_long_sequences", "10b_fp8"} <= {p.stem for p in CHAPTERS}


@pytest.mark.parametrize("text", [
    "The source article is in `../shared/seeds/002.txt`.",
    "**Seed sections.** 002 \"Data Parallelism\".",
    "Seed 004 says NCCL does not run multi-node.",
    "Seeds 000, 002 and 003 all say: combine pipeline parallelism with ZeRO-1 only.",
    "The method seed 003 §4 names.",
    "Where the seeds are wrong (each shown below).",
    "Beyond the seeds: Ulysses.",
    "The seed's table, checked.",
    "The seeds' decision guide, as rules.",
    "**Seeds.** 000 (Zero模式), 002.",
    "Seeds: 001 (GPT-3's device layout).",
    "The seed says so too.",
    "| seed says | checked |",
    "Every step (002's list, corrected):",
    "Both follow GShard's design, the plan 003 §7 calls \"MoE parallel\".",
    "the copies drift apart (001: \"模型不一致\").",
    "SYLLABUS §06 (the Colossal-AI half).",
    "Adam can magnify it (CONTRIBUTING's first lesson).",
    "The test `tests/test_ddp.py::test_no_sync_pitfall_is_caught` does both.",
    "`minipar/course/ch12_choosing_a_strategy/test_chapter.py` reruns a fast subset.",
    "so `make figures` redraws it the same.",
    "Run make test before you push.",
])
def test_the_rules_catch_authoring_language(text):
    assert problems_in(text), text


@pytest.mark.parametrize("text", [
    "Dropout uses a random seed: the same seed draws the same masks.",
    "A per-rank seed everywhere would break TP; a dropout seed must differ across TP ranks.",
    "Megatron's generator is seeded `seed + 2718 + tp_rank`; call `model(seed=0)`.",
    "`minipar.debug.seeds.megatron_seeds` draws them; seeds and NaNs; seeding by rank.",
    "The models are deterministic from a seed, and the data is shared across ranks.",
    "Tests of equality make the case; the shared / private split; make sure it fits.",
    "The source article *并行训练* says NCCL does not run multi-node; that is wrong.",
    "A learning rate of 0.001, 1,000 steps, the year 2004, `torch.manual_seed(002)` and ε = 1e-004.",
])
def test_the_rules_allow_random_seeds_and_plain_english(text):
    assert not problems_in(text), problems_in(text)


# ----------------------------------------------------------------------------------------------------
# The lesson reads as a lesson (issue 49): no assert statements in a chapter's cells (a chapter package's
# ``claims.py`` holds them and prints nothing when all hold), no words about how the checks are built in its
# markdown, and no harness text in what the chapters print.
# ----------------------------------------------------------------------------------------------------

HARNESS_WORDS = [
    ("says a claim is asserted", re.compile(r"\basserted\b", re.I)),
    ("names a check() call", re.compile(r"(?<!\w)check\(\)")),            # `study.check()`; not `desync_check()`
    ("says a sentence is generated", re.compile(r"\bgenerated\s+from\b", re.I)),
    ("shouts RECORDED", re.compile(r"\bRECORDED\b")),
]
HARNESS_OUTPUT = ["RECORDED", "no guess written", "type your number"]


def harness_words_in(markdown: str) -> list:
    """(rule, sentence) for each word about the course's checks in one markdown cell's source."""
    return [(what, _sentence(markdown, m.start(), m.end())) for what, rule in HARNESS_WORDS
            for m in rule.finditer(markdown)]


def _code_cells(path: Path) -> list:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def asserts_in(code: str) -> list:
    """Line numbers of the assert statements in one code cell (IPython's % and ! lines left out)."""
    plain = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in code.split("\n"))
    return [n.lineno for n in ast.walk(ast.parse(plain)) if isinstance(n, ast.Assert)]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_assert_in_a_chapter(path):
    found = [f"{path.stem} cell {i} line {line}" for i, code in _code_cells(path) for line in asserts_in(code)]
    assert not found, "assert statements in a lesson (move them to the chapter's claims.py):\n" + "\n".join(found)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_words_about_the_checks_in_a_chapter(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found = [f"{path.stem} cell {i}: {what}: {sentence}"
             for i, cell in enumerate(cells) if cell["cell_type"] == "markdown"
             for what, sentence in harness_words_in("".join(cell["source"]))]
    assert not found, "words about the course's checks in front of the learner:\n" + "\n".join(found)


def _printable_strings(source: str) -> list:
    """The string literals (and f-strings' literal parts) of a Python source."""
    return [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_harness_text_in_what_the_chapters_print():
    sources = [(p.relative_to(ROOT), p.read_text(encoding="utf-8")) for p in (ROOT / "minipar" / "course").rglob("*.py")
               if not p.name.startswith("test_")]
    sources += [(f"{p.stem} cell {i}", code) for p in CHAPTERS for i, code in _code_cells(p)
                if not code.lstrip().startswith(("%", "!"))]
    found = [f"{where}: {text!r}" for where, source in sources
             for text in _printable_strings("\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                                       for line in source.split("\n")))
             if any(word in text for word in HARNESS_OUTPUT)]
    assert not found, "harness text the learner would read:\n" + "\n".join(found)


def test_a_reveal_without_a_guess_prints_the_answer_plainly(capsys):
    from minipar.course.predict import reveal
    reveal(None, 12, what="all-reduces per layer", formula=12)
    reveal(None, 4, what="all-gathers per layer")
    out = capsys.readouterr().out
    assert "measured 12" in out and "measured 4" in out and "guess" not in out.lower()
    assert not any(word in out for word in HARNESS_OUTPUT), out


@pytest.mark.parametrize("text", [
    "each sentence is asserted in the cell above", "Asserted for every rank.", "`study.check()` holds them",
    "and check() raises", "the sentence is generated from the ratios", "RECORDED (not run now)",
])
def test_the_rules_catch_words_about_the_checks(text):
    assert harness_words_in(text), text


@pytest.mark.parametrize("text", [
    "inside `with desync_check():` every collective is checked", "a recorded run, not re-run now",
    "the assertion fails on rank 2", "Recorded on 2025-01-01 with `python -m minipar bench torch-side`",
    "the gradients generated by backward",
])
def test_the_rules_allow_plain_words(text):
    assert not harness_words_in(text), harness_words_in(text)


def test_assert_statements_are_found():
    assert asserts_in("%matplotlib inline\nx = 1\nassert x == 1\nfor i in range(2):\n    assert i < 2") == [3, 5]
    assert asserts_in("c.assert_ok()\nprint('assert')") == []


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_lists_its_sources_in_a_box_at_its_end(path):
    """The README promises each chapter's "Sources and corrections" box at its end, just before the check
    questions: the lesson first (reviewers found the corrections of unseen articles a poor opening)."""
    box = nbformat.read(path, as_version=4).cells[-2]
    assert box.cell_type == "markdown" and "<summary>Sources and corrections</summary>" in box.source, path.name

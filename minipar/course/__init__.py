"""The course around the library: one folder per chapter, and the runners that find them.

A chapter ``NN_topic`` (the name of its notebook ``notebooks/NN_topic.ipynb``, its solutions
``solutions/NN_topic.ipynb`` and exercises ``exercises/NN_topic.ipynb``) has one folder here,
``minipar/course/chNN_topic/``, holding the same small set of files as every other chapter, each optional:

==================  ===============================================================================
``__init__.py``     the chapter's title in its docstring's first line
``tour.py``         ``STRATEGIES = [(name, run)]``: its rows in ``python -m minipar tour``
``figures.py``      ``FIGURES = {"NN_name.png": make(path)}``: its pictures in ``figures/``
``checks.py``       the exercise checks its solution notebook calls (raise :class:`checks.ExerciseError`)
``bench.py``        ``BENCHMARKS = {"name": main(argv)}``: ``python -m minipar bench name``
``test_chapter.py`` tests of its tour rows, figures helpers and checks (wrong answers kept here)
==================  ===============================================================================

Its title, one-line summary, route (core or elective), minutes to read and seconds to run are one entry of
:data:`.syllabus.ABOUT` (``Chapter.about``), from which the README's chapter table and the site's chapter map
are written.

The runners (:mod:`.tour`, :mod:`.figures`, :mod:`.bench`, :mod:`.exercises`) find chapters through
:func:`chapters` and :func:`collect` only, so adding a chapter never touches them. The library
(``minipar`` outside this package) never imports course code; ``tests/test_layout.py`` holds that.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Chapter", "chapters", "chapter", "collect", "ROOT"]

ROOT = Path(__file__).resolve().parents[2]   # the repository (minipar is installed editable)


@dataclass(frozen=True)
class Chapter:
    number: str        # "03", "06b"
    name: str          # "03_zero_and_fsdp": notebook, solution, exercise and figure prefix
    package: str       # "minipar.course.ch03_zero_and_fsdp"

    @property
    def notebook(self) -> Path:
        return ROOT / "notebooks" / f"{self.name}.ipynb"

    @property
    def solution(self) -> Path:
        return ROOT / "solutions" / f"{self.name}.ipynb"

    @property
    def exercise(self) -> Path:
        return ROOT / "exercises" / f"{self.name}.ipynb"

    @property
    def about(self):
        """Title, summary, route, minutes and seconds (:mod:`.syllabus`)."""
        from .syllabus import about
        return about(self.number)

    def module(self, part: str):
        """The chapter's ``part`` module (``"tour"``, ``"figures"``, ...), or None if it has none."""
        try:
            return importlib.import_module(f"{self.package}.{part}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{self.package}.{part}":
                raise            # the module exists but one of its own imports is missing: say so
            return None


def chapters() -> list:
    """Every chapter folder ``chNN_topic`` in this package, in chapter order."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg and info.name.startswith("ch") and "_" in info.name:
            number, _, topic = info.name[2:].partition("_")
            found.append(Chapter(number, f"{number}_{topic}", f"{__name__}.{info.name}"))
    return sorted(found, key=lambda c: c.name)


def chapter(key: str) -> Chapter:
    """A chapter by number (``"03"``) or name (``"03_zero_and_fsdp"``)."""
    for c in chapters():
        if key in (c.number, c.name):
            return c
    raise KeyError(f"no chapter {key!r}; chapters: {', '.join(c.name for c in chapters())}")


def collect(part: str, attribute: str) -> list:
    """``[(chapter, value)]`` of ``chapter.part.attribute`` over every chapter that has that module."""
    out = []
    for c in chapters():
        module = c.module(part)
        if module is not None and hasattr(module, attribute):
            out.append((c, getattr(module, attribute)))
    return out

"""A chapter's printed table as one value: the cell that shows it is one call, its plumbing lives in the
chapter's course folder.

``Report(text, checks, **numbers)``: ``text`` is what the cell prints; the numbers are attributes
(``report.rows``); ``check()`` runs ``checks(report)``, the assertions that hold the chapter's sentences about
those numbers.
"""
from __future__ import annotations

__all__ = ["Report"]


class Report:
    """``text`` (printed, and the cell's displayed value), the numbers by name, ``check()``."""

    def __init__(self, text: str, checks=None, **facts):
        self.text, self._checks, self.facts = text, checks, facts
        self.__dict__.update(facts)

    def check(self) -> None:
        """Assert what the chapter's text says about these numbers."""
        if self._checks is not None:
            self._checks(self)

    def __repr__(self) -> str:
        return self.text

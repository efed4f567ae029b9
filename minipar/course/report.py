"""A chapter's printed table as one value: the cell that shows it is one call, its plumbing lives in the
chapter's course folder.

``Report(text, checks, **numbers)``: ``text`` is what the cell prints; the numbers are attributes
(``report.rows``); ``check()`` runs ``checks(report)``, the assertions that hold the chapter's sentences about
those numbers.
"""
from __future__ import annotations

__all__ = ["Report", "against_one_device", "show_source"]


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


def against_one_device(c, brief: bool = False) -> str:
    """One line for a :class:`minipar.check.Comparison` (its ``str``: "= one device" with the largest
    difference and the tolerance it met, or the mismatch with every problem); ``brief``: a mismatch the cell
    expects, only the largest difference and where."""
    if not c.matches and brief:
        return f"differs from one device: max |Δ| {c.max_abs_diff:.2g} (at {c.worst})"
    return str(c)


def show_source(*objs, folded: str | None = None):
    """The library's own source of ``objs``, read live (``inspect.getsource``, dedented: a method reads as a
    function), as Markdown for a notebook; ``folded``: the summary line of a collapsed block to show it under."""
    import inspect
    import textwrap
    from IPython.display import Markdown
    code = "\n".join(f"```python\n{textwrap.dedent(inspect.getsource(o))}\n```" for o in objs)
    return Markdown(f"<details><summary>{folded}</summary>\n\n{code}\n</details>" if folded else code)

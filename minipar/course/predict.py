"""Predict first, then measure: the learner writes a guess in a variable before a run, and the cell after the
run shows the guess beside what the program really did (and the formula, where there is one).

In a chapter::

    # Predict first: how many bytes does each of 4 ranks send in a ring all-reduce of 1 MiB?
    my_guess = None          # your number here, before you run the next cell

    ...the run...
    reveal(my_guess, measured, what="bytes sent per rank", formula=comm.predicted_bytes_sent(...))

A guess left at ``None`` is fine: the reveal shows the answer alone, with nothing about guessing (the notebooks are
committed with ``None``, so that "Run All" and the static site go through, and the site shows the answer plainly).
Numbers are compared as a ratio; any other guess (a schedule's name, "yes") is compared as text,
case-insensitively.
"""
from __future__ import annotations

__all__ = ["reveal", "verdict", "Revealed"]

class Revealed(str):
    """The line :func:`reveal` printed. Jupyter shows a cell's last value; this one shows nothing more, so that
    a cell ending in ``reveal(...)`` prints its line once."""

    def _ipython_display_(self):
        pass


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:,.4g}"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return str(x)


def verdict(guess, measured, *, rel_tol: float = 0.1) -> str:
    """One line judging ``guess`` against ``measured``: within ``rel_tol``, off by a factor, or different."""
    if guess is None:
        return "no guess"
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (guess, measured))
    if not numbers:
        same = str(guess).strip().lower() == str(measured).strip().lower()
        return "right" if same else "not what happened"
    if measured == 0:
        return "right" if guess == 0 else "off: the measured value is 0"
    if guess == 0:
        return "off: you guessed 0"
    ratio = guess / measured
    if abs(ratio - 1) <= rel_tol:
        return f"right (within {rel_tol:.0%})"
    return f"off by ×{ratio:.3g}" if ratio > 1 else f"off by ×1/{1 / ratio:.3g}"


def reveal(guess, measured, *, what: str, formula=None, unit: str = "", rel_tol: float = 0.1,
           source: str = "measured") -> Revealed:
    """Print and return ``what``: the answer, the formula's value when given, your guess and :func:`verdict`
    (returned as :class:`Revealed`, which a notebook does not display a second time). Without a guess, the line
    is the answer alone. ``source`` labels the answer by where it came from: "measured" (what the run did),
    "logged" (the communication log: a collective's bytes there are its algorithm's share of the payload, a
    model; a send's are the tensor sent), "simulated", "model", "planner" (a model of a declared cluster)."""
    u = f" {unit}" if unit else ""
    parts = [f"{what}: {source} {_fmt(measured)}{u}"]
    if formula is not None:
        parts.append(f"formula {_fmt(formula)}{u}")
    if guess is not None:
        parts.append(f"your guess {_fmt(guess)}{u}")
    if guess is None:
        line = "; ".join(parts) + "."
    else:
        line = "; ".join(parts) + f"  ->  {verdict(guess, measured, rel_tol=rel_tol)}"
    print(line)
    return Revealed(line)

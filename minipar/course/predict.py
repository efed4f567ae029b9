"""Predict first, then measure: the learner writes a guess in a variable before a run, and the cell after the
run shows the guess beside what the program really did (and the formula, where there is one).

In a chapter::

    # Predict first: how many bytes does each of 4 ranks send in a ring all-reduce of 1 MiB?
    my_guess = None          # your number here, before you run the next cell

    ...the run...
    reveal(my_guess, measured, what="bytes sent per rank", formula=comm.predicted_bytes_sent(...))

A guess left at ``None`` is fine: the reveal shows the answer and, the first time in a kernel, says what to type
where; later reveals say only "no guess written" (the notebooks are committed with ``None``, so that "Run All",
the tests and the static site go through). Numbers are compared as a ratio; any other guess
(a schedule's name, "yes") is compared as text, case-insensitively.
"""
from __future__ import annotations

__all__ = ["reveal", "verdict", "Revealed"]

NO_GUESS = ("no guess written: in JupyterLab, type your number (or answer) into the predict cell's variable, "
            "run that cell, then this one")
NO_GUESS_AGAIN = "no guess written"

_told_how_to_guess = False   # the long sentence has been printed in this process (kernel)


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
        return NO_GUESS
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


def reveal(guess, measured, *, what: str, formula=None, unit: str = "", rel_tol: float = 0.1) -> Revealed:
    """Print and return ``what``: measured, the formula's value when given, your guess and :func:`verdict`
    (returned as :class:`Revealed`, which a notebook does not display a second time). Without a guess, the
    sentence saying what to type is printed once per process; later reveals say only "no guess written"."""
    global _told_how_to_guess
    u = f" {unit}" if unit else ""
    parts = [f"{what}: measured {_fmt(measured)}{u}"]
    if formula is not None:
        parts.append(f"formula {_fmt(formula)}{u}")
    if guess is not None:
        parts.append(f"your guess {_fmt(guess)}{u}")
    judged = verdict(guess, measured, rel_tol=rel_tol)
    if guess is None:
        judged, _told_how_to_guess = (NO_GUESS_AGAIN if _told_how_to_guess else NO_GUESS), True
    line = "; ".join(parts) + f"  ->  {judged}"
    print(line)
    return Revealed(line)

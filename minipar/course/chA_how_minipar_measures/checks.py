"""Check for appendix A's exercise: count how two columns of step times rank the same strategies, only where
both columns can tell them apart (:func:`.time_model.ranking_outside_spread`, Goodman and Kruskal's γ over
the pairs whose ranges do not overlap on either side)."""
from __future__ import annotations

from minipar.course.checks import fail

from .time_model import ranking_outside_spread

__all__ = ["check_count_pairs", "CASES"]


def _s(median, lo, hi):
    return {"median": median, "min": lo, "max": hi}


# (predicted, measured): {strategy: {"median", "min", "max"}} seconds per step, smaller is faster
CASES = [
    ({"A": _s(1.0, 0.9, 1.1), "B": _s(2.0, 1.9, 2.1), "C": _s(3.0, 2.9, 3.1)},       # same order, all apart
     {"A": _s(1.2, 1.0, 1.3), "B": _s(2.2, 2.0, 2.4), "C": _s(3.5, 3.1, 3.9)}),
    ({"A": _s(1.0, 0.9, 1.1), "B": _s(2.0, 1.9, 2.1), "C": _s(3.0, 2.9, 3.1)},       # B, C swapped, A-B tied
     {"A": _s(1.5, 1.0, 2.0), "B": _s(1.8, 1.6, 2.2), "C": _s(1.2, 1.1, 1.3)}),
    ({"DDP": _s(0.10, 0.10, 0.10), "TP": _s(0.20, 0.20, 0.20), "PP": _s(0.15, 0.149, 0.151), "Z3": _s(0.3, 0.3, 0.3)},
     {"DDP": _s(0.12, 0.11, 0.14), "TP": _s(0.13, 0.12, 0.16), "PP": _s(0.30, 0.25, 0.35), "Z3": _s(0.5, 0.4, 0.6)}),
    ({"A": _s(1.0, 0.9, 1.2), "B": _s(1.1, 1.0, 1.3), "C": _s(3.0, 2.9, 3.1), "D": _s(4.0, 3.9, 4.1)},  # A, B tied in the model
     {"A": _s(1.0, 0.9, 1.1), "B": _s(2.0, 1.9, 2.1), "C": _s(3.0, 2.9, 3.1), "D": _s(3.05, 3.0, 3.2)}),  # C, D tied in the runs
]


def _hint(pred, meas, got, want) -> str:
    names = sorted(meas)
    pairs = len(names) * (len(names) - 1) // 2
    apart_measured = sum(1 for i, a in enumerate(names) for b in names[i + 1:]
                         if meas[a]["max"] < meas[b]["min"] or meas[b]["max"] < meas[a]["min"])
    if len(got) == 3 and got[0] + got[1] == apart_measured != want[0] + want[1] and apart_measured < pairs:
        return "a pair must be apart on both sides: the prediction's ranges can overlap too"
    if len(got) == 3 and got[0] + got[1] == pairs and want[2]:
        return ("you ordered every pair by its medians: a pair whose ranges overlap (on either side) is a tie — "
                "the runs do not say which is faster, so it counts for neither")
    return ("for each pair (a, b): apart when a's max < b's min or b's max < a's min, in both columns; then "
            "concordant if the medians order them the same way in both, discordant if not; else tied")


def check_count_pairs(count_pairs) -> None:
    """``count_pairs(predicted, measured)`` -> (concordant, discordant, tied) over every pair of strategies,
    as :func:`.time_model.ranking_outside_spread` counts them."""
    for pred, meas in CASES:
        r = ranking_outside_spread(pred, meas)
        want = (r["concordant"], r["discordant"], len(r["tied"]))
        got = count_pairs(pred, meas)
        try:
            got = tuple(int(x) for x in got)
        except TypeError:
            fail(f"count_pairs on {sorted(meas)}", want, got, "return three numbers: (concordant, discordant, tied)")
        if got != want:
            fail(f"count_pairs on {sorted(meas)}", want, got, _hint(pred, meas, got, want))
    print(f"right: concordant, discordant and tied pairs of {len(CASES)} rankings, as the appendix counts them")

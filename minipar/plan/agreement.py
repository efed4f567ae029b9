"""Does a prediction rank strategies as the measurements (or a replay) do? Kendall's τ-b and the picks.

Kendall's τ-b (Kendall 1945, "The treatment of ties in ranking problems", Biometrika 33) over the n(n−1)/2
pairs of strategies: a pair is *concordant* when both orderings put the same one first, *discordant* when
they disagree, and tied in x (or y) when its two values are equal there::

    τ_b = (n_c − n_d) / √((n₀ − n₁)(n₀ − n₂)),   n₀ = n(n−1)/2, n₁ / n₂ the pairs tied in x / in y

1 is the same order, −1 the reverse, 0 no relation. Ties are equal values; whether a gap is larger than the
run-to-run noise is for the caller to say (``python -m minipar bench replay`` counts the runs in which the
order held). Pure functions; no scipy.
"""
from __future__ import annotations

import math

__all__ = ["kendall_tau", "rank_agreement", "agreement_text"]


def kendall_tau(x, y) -> float:
    """τ-b of the paired sequences ``x`` and ``y`` (ties handled); nan when either has every pair tied."""
    x, y = list(x), list(y)
    if len(x) != len(y):
        raise ValueError(f"x and y must pair up: {len(x)} values against {len(y)}")
    if len(x) < 2:
        raise ValueError("a ranking needs at least 2 values")
    concordant = discordant = tied_x = tied_y = pairs = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            pairs += 1
            tx, ty = x[i] == x[j], y[i] == y[j]
            tied_x += tx
            tied_y += ty
            if not (tx or ty):
                same = (x[i] < x[j]) == (y[i] < y[j])
                concordant += same
                discordant += not same
    denominator = math.sqrt((pairs - tied_x) * (pairs - tied_y))
    return (concordant - discordant) / denominator if denominator else math.nan


def rank_agreement(predicted: dict, observed: dict) -> dict:
    """Compare ``predicted`` and ``observed`` {strategy: seconds per step} (smaller is better).

    Returns {"tau": Kendall's τ-b, "predicted_order" / "observed_order": names fastest first,
    "predicted_pick" / "observed_pick": the fastest of each, "picks_agree", "pick_gap": how much slower, as
    observed, the predicted pick is than the observed best (1.0 when they agree), "rows": [{"name",
    "predicted", "observed", "ratio": predicted/observed, "predicted_rank", "observed_rank"}] in observed order}."""
    if set(predicted) != set(observed):
        raise ValueError(f"the same strategies are needed on both sides: only predicted "
                         f"{sorted(set(predicted) - set(observed))}, only observed {sorted(set(observed) - set(predicted))}")
    for side, values in (("predicted", predicted), ("observed", observed)):
        bad = [k for k, v in values.items() if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v))]
        if bad:
            raise ValueError(f"{side} step times must be positive numbers; not so for {bad}")
    names = list(observed)
    tau = kendall_tau([predicted[k] for k in names], [observed[k] for k in names])
    p_order = sorted(names, key=lambda k: predicted[k])
    o_order = sorted(names, key=lambda k: observed[k])
    rows = [{"name": k, "predicted": predicted[k], "observed": observed[k], "ratio": predicted[k] / observed[k],
             "predicted_rank": p_order.index(k) + 1, "observed_rank": o_order.index(k) + 1} for k in o_order]
    pick, best = p_order[0], o_order[0]
    return {"tau": tau, "predicted_order": p_order, "observed_order": o_order, "predicted_pick": pick,
            "observed_pick": best, "picks_agree": observed[pick] == observed[best],
            "pick_gap": observed[pick] / observed[best], "rows": rows}


def agreement_text(agreement: dict, unit: float = 1e-3, unit_name: str = "ms",
                   labels=("predicted", "observed")) -> str:
    """:func:`rank_agreement`'s result as a table (observed order) and a verdict line, ready to print."""
    p, o = labels
    lines = [f"{'strategy':12}{p:>12}{o:>12}{p + '/' + o:>22}{'ranks':>8}"]
    for r in agreement["rows"]:
        shown = [f"{r[k] / unit:.3f} {unit_name}" for k in ("predicted", "observed")]
        lines.append(f"{r['name']:12}{shown[0]:>12}{shown[1]:>12}{r['ratio']:>22.2f}"
                     f"{r['predicted_rank']:>5} {r['observed_rank']:<2}")
    verdict = "agree" if agreement["picks_agree"] else (
        f"disagree ({o}, the {p} pick is ×{agreement['pick_gap']:.2f} the best's time)")
    lines.append(f"Kendall tau-b {agreement['tau']:.3f}; {p} pick {agreement['predicted_pick']}, {o} best "
                 f"{agreement['observed_pick']}: {verdict}")
    return "\n".join(lines)

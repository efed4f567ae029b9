"""``python -m minipar bench published [--json] [--fit]``: the planner's step time for published training runs
(:mod:`minipar.plan.published`) beside what their papers report — the check of the model of time against real
clusters. Each row is a card's **calibration** (the one run its fitted number was fitted to) or a **check**
(fitted to nothing); the last line counts the checks within ±15 % and names those outside. A report, not a
test: it exits 0 whatever the count (``--json`` gives the rows with their role and source, and the summary).

``--fit`` repeats the one fit the device cards carry (each card's large-matmul efficiency over its runs) and
prints it beside the constant in the card. No process starts: this is arithmetic on the cards.
"""
from __future__ import annotations

import argparse
import json

from minipar.machine.device import CARDS, FITTED
from minipar.plan.published import RUNS, fit_gemm_efficiency, mt_nlg_against_korthikanti, summary, table, table_text

__all__ = ["TOLERANCE", "main"]

TOLERANCE = 0.15


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar bench published", allow_abbrev=False)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--fit", action="store_true", help="redo the fit of each card's matmul efficiency")
    args = parser.parse_args(argv)
    rows = table()
    if args.json:
        print(json.dumps({"tolerance": TOLERANCE, "rows": rows, "summary": summary(rows, TOLERANCE),
                          "fitted": FITTED, "mt_nlg_against_korthikanti": mt_nlg_against_korthikanti()}, indent=1))
    else:
        print("Seconds per iteration: published, and the planner's model on the declared cards (a model).")
        print(table_text(rows, TOLERANCE))
        for name, what in FITTED.items():
            print(f"{name}: {what}")
    if args.fit:
        for name in FITTED:
            card = CARDS[name]
            runs = [r for r in RUNS if r.card is card and r.calibration]
            if not runs:                          # a card with nothing fitted: its number is measured
                print(f"fit {name}: nothing to fit (no calibration row)")
                continue
            eta, worst = fit_gemm_efficiency(runs, card)
            print(f"fit {name}: gemm_efficiency {eta:.3f} (card: {card.gemm_efficiency:.3f}), worst error "
                  f"{worst:.1%} over {len(runs)} run(s)")
    return 0

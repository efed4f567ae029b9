"""``python -m minipar bench published [--json] [--fit]``: the planner's step time for published training runs
(:mod:`minipar.plan.published`) beside what their papers report — the check of the model of time against real
clusters, every row within ±15 % or the command fails (exit 1).

``--fit`` repeats the one fit the device cards carry (each card's large-matmul efficiency over its runs) and
prints it beside the constant in the card. No process starts: this is arithmetic on the cards.
"""
from __future__ import annotations

import argparse
import json

from minipar.machine.device import CARDS, FITTED
from minipar.plan.published import RUNS, fit_gemm_efficiency, table, table_text

__all__ = ["TOLERANCE", "main"]

TOLERANCE = 0.15


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar bench published", allow_abbrev=False)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--fit", action="store_true", help="redo the fit of each card's matmul efficiency")
    args = parser.parse_args(argv)
    rows = table()
    outside = [r["run"] for r in rows if abs(r["ratio"] - 1) > TOLERANCE]
    if args.json:
        print(json.dumps({"tolerance": TOLERANCE, "rows": rows, "fitted": FITTED}, indent=1))
    else:
        print("Seconds per iteration: published, and the planner's model on the declared cards (a model).")
        print(table_text(rows))
        for name, what in FITTED.items():
            print(f"fitted on {name}: {what}")
        print(f"{len(rows) - len(outside)} of {len(rows)} rows within ±{TOLERANCE:.0%}"
              + (f"; outside: {', '.join(outside)}" if outside else ""))
    if args.fit:
        for name in FITTED:
            card = CARDS[name]
            runs = [r for r in RUNS if r.card is card and r.fitted]
            eta, worst = fit_gemm_efficiency(runs, card)
            print(f"fit {name}: gemm_efficiency {eta:.3f} (card: {card.gemm_efficiency:.3f}), worst error "
                  f"{worst:.1%} over {len(runs)} run(s)")
    return 1 if outside else 0

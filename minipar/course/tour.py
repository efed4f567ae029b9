"""The main job: every strategy implemented so far, on 4 CPU ranks, in one table.

Each chapter's ``minipar/course/chNN_topic/tour.py`` defines ``STRATEGIES``: a list of ``(name, run)``
pairs where ``run()`` launches the strategy, checks it against the single-device reference and returns a
:class:`TourRow`. The tour finds them with :func:`minipar.course.collect`, in chapter order, so adding a
chapter's rows never touches this file.

    python -m minipar tour            # the table
    python -m minipar tour --json     # one JSON object per row
    python -m minipar tour -k zero    # only the strategies whose name contains "zero"
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

__all__ = ["TourRow", "strategies", "run_tour", "format_table", "main"]

WORLD_SIZE = 4


@dataclass
class TourRow:
    strategy: str
    world_size: int
    matches: bool
    max_abs_diff: float | None
    bytes_sent_per_rank: float | None      # measured in the communication log (mean over ranks)
    bytes_formula: float | None            # the closed-form prediction for the same quantity
    peak_bytes_per_rank: float | None      # measured peak of live tensors during a step (max over ranks)
    note: str = ""
    seconds: float = 0.0
    bytes_observed_per_rank: float | None = None   # what the transport really sent (minipar.wire), mean over ranks


def strategies() -> list:
    """[(chapter name, strategy name, run)] in chapter order."""
    from . import collect
    return [(chapter.name, name, run) for chapter, rows in collect("tour", "STRATEGIES") for name, run in rows]


def run_tour(select: str | None = None, progress=None) -> list:
    progress = progress or sys.stderr  # looked up at call time, so a redirected stderr sees the lines
    rows = []
    chosen = [s for s in strategies() if select is None or select.lower() in s[1].lower()]
    for i, (_, name, run) in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {name} ...", file=progress, flush=True)
        t0 = time.perf_counter()
        row = run()
        row.seconds = time.perf_counter() - t0
        rows.append(row)
    return rows


def _fmt_bytes(x) -> str:
    if x is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def format_table(rows) -> str:
    head = ("strategy", "ranks", "matches 1 device (max |Δ|)", "bytes sent/rank", "formula", "peak mem/rank")
    body = []
    for r in rows:
        diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}"
        body.append((r.strategy, str(r.world_size), f"{'yes' if r.matches else 'NO'} ({diff})",
                     _fmt_bytes(r.bytes_sent_per_rank), _fmt_bytes(r.bytes_formula),
                     _fmt_bytes(r.peak_bytes_per_rank)))
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(tuple("-" * w for w in widths))] + [line(b) for b in body]
    return "\n".join(out)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m minipar tour", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per row")
    parser.add_argument("-k", dest="select", help="only strategies whose name contains this")
    args = parser.parse_args(argv)
    rows = run_tour(args.select)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(format_table(rows))
        bad = [r.strategy for r in rows if not r.matches]
        print(f"\n{len(rows) - len(bad)} of {len(rows)} strategies match single-device results"
              + (f"; NOT: {', '.join(bad)}" if bad else ""))
    return 0 if all(r.matches for r in rows) else 1

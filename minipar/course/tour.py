"""The main job: every strategy implemented so far, on 4 CPU ranks, in one table.

Each chapter's ``minipar/course/chNN_topic/tour.py`` defines ``STRATEGIES``: a list of ``(name, run)``
pairs where ``run()`` launches the strategy, checks it against the single-device reference and returns a
:class:`TourRow`. The tour finds them with :func:`minipar.course.collect`, in chapter order, so adding a
chapter's rows never touches this file.

    python -m minipar tour            # the table, each row's note as a footnote, a headline that counts
    python -m minipar tour --json     # one JSON object per row (bytes_observed_per_rank included)
    python -m minipar tour -k zero    # only the strategies whose name contains "zero"
    python -m minipar tour --trace DIR   # also DIR/<row>.json: a minipar.machine.trace.Trace of each row's run

With ``--trace`` every launch a row makes is traced by the launcher (:mod:`minipar.observe.launch_trace`; no strategy
holds tracing code) and the row's last launch on its own world size is saved (``trace.load`` reads it back);
a row that launches nothing of its own (it reuses an earlier row's run, or runs in threads) gets no file.

Three byte columns, per rank (mean over ranks unless the note says otherwise):

* ``model``: what :mod:`minipar.comm`'s log says the algorithm sends (the ring model of each collective);
* ``observed``: what the process really wrote to its sockets meanwhile (:mod:`minipar.wire`, the kernel's
  per-process counter): the transport's truth, gloo's framing and gloo's own algorithms included;
* ``formula``: the closed form the chapter teaches.

``obs/formula`` is their ratio. Observed bytes count as "within protocol overhead" of the formula when they
exceed it by at most :data:`OVERHEAD_PER_CALL` bytes per logged call (gloo's message headers: ~150 B per
message, ~1.7 KiB for a 4-rank all-reduce) plus 1 % — or, for a row that does not report its calls, 5 %.
A row outside that says why in its note (gloo's reduce-scatter all-reduces: 2×; its reduce: 1.25×).

What a row's ``matches`` means depends on its ``kind``: ``"training"`` — losses and parameters after real
optimizer steps equal one device's; ``"collective"`` — what every rank holds after one operation equals the
same result computed on one process; ``"update rule"`` — an asynchronous schedule (PipeDream) equals a
single-process simulation of its own, different, update rule; ``"bitwise"`` — losses and parameters after real
optimizer steps are ``torch.equal`` to one device's, both in the invariant mode (:mod:`minipar.invariant_mode`),
no tolerance. The headline counts them apart.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass

__all__ = ["TourRow", "KINDS", "OVERHEAD_PER_CALL", "strategies", "run_tour", "observed_status",
           "format_table", "headline", "main", "save_row_trace", "trace_file_name"]

WORLD_SIZE = 4
KINDS = ("training", "collective", "update rule", "bitwise")
OVERHEAD_PER_CALL = 2048          # bytes of transport framing allowed per logged call (see the docstring)


@dataclass
class TourRow:
    strategy: str
    world_size: int
    matches: bool
    max_abs_diff: float | None
    bytes_sent_per_rank: float | None      # the communication log's model of the algorithm (mean over ranks)
    bytes_formula: float | None            # the closed-form prediction for the same quantity
    peak_bytes_per_rank: float | None      # measured peak of live tensors during a step (max over ranks)
    note: str = ""
    seconds: float = 0.0
    bytes_observed_per_rank: float | None = None   # what the transport really sent (minipar.wire), mean over ranks
    kind: str = "training"                 # what `matches` compares: see KINDS and the module docstring
    calls_per_rank: float | None = None    # logged calls behind bytes_observed_per_rank (for the allowance)


def strategies() -> list:
    """[(chapter name, strategy name, run)] in chapter order."""
    from . import collect
    return [(chapter.name, name, run) for chapter, rows in collect("tour", "STRATEGIES") for name, run in rows]


def run_tour(select: str | None = None, progress=None, trace_dir=None) -> list:
    """Run the rows whose name contains ``select`` (all by default); with ``trace_dir``, save each row's
    trace there (:func:`save_row_trace`)."""
    progress = progress or sys.stderr  # looked up at call time, so a redirected stderr sees the lines
    rows = []
    chosen = [s for s in strategies() if select is None or select.lower() in s[1].lower()]
    from ..progress import bar
    steps = bar(chosen, desc="tour", unit="strategy")      # a bar in a terminal or notebook, silent in logs
    for i, (_, name, run) in enumerate(steps, 1):
        steps.write(f"[{i}/{len(chosen)}] {name} ...", file=progress)
        t0 = time.perf_counter()
        if trace_dir is None:
            row = run()
        else:
            from minipar.observe.launch_trace import recording_launches
            with recording_launches() as traces:
                row = run()
        row.seconds = time.perf_counter() - t0
        if trace_dir is not None:
            saved = save_row_trace(trace_dir, name, row.world_size, traces)
            steps.write(f"  trace: {saved or 'none (no launch of its own)'}", file=progress)
        rows.append(row)
    return rows


def trace_file_name(strategy: str) -> str:
    """The file a row's trace goes to: its name with every run of other characters than letters, digits,
    ``+``, ``.`` and ``-`` made one ``_``, then ``.json``."""
    return re.sub(r"[^A-Za-z0-9+.-]+", "_", strategy).strip("_") + ".json"


def save_row_trace(directory, strategy: str, world_size: int, traces: list):
    """Save the last of ``traces`` on ``world_size`` ranks (else the last) as ``directory/<row>.json``;
    return its path, or None when the row launched nothing."""
    if not traces:
        return None
    own = [t for t in traces if t.world_size == world_size] or traces
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, trace_file_name(strategy))
    own[-1].meta.update(strategy=strategy, launches=len(traces))
    own[-1].save(path)
    return path


def observed_status(row) -> str | None:
    """``"within"`` (observed ≥ formula − 1 % and ≤ formula + the protocol allowance), ``"differs"`` (the
    note says why), or None where nothing was observed or there is no formula."""
    obs, formula = row.bytes_observed_per_rank, row.bytes_formula
    if obs is None or formula is None:
        return None
    if row.calls_per_rank is not None:
        allowance = OVERHEAD_PER_CALL * row.calls_per_rank + 0.01 * formula
    else:
        allowance = 0.05 * formula
    return "within" if formula - 0.01 * formula <= obs <= formula + allowance else "differs"


def _fmt_bytes(x) -> str:
    if x is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def _ratio(row) -> str:
    obs, formula = row.bytes_observed_per_rank, row.bytes_formula
    if obs is None or not formula:
        return "-"
    return f"{obs / formula:.2f}" + ("" if observed_status(row) == "within" else " !")


def format_table(rows, notes: bool = True) -> str:
    """The table; with ``notes``, each row's note as a footnote [n] under it (`!`: observed differs from
    the formula by more than the protocol allowance, the note says why; `†`: not compared with one device)."""
    head = ("strategy", "ranks", "matches (max |Δ|)", "model B/rank", "observed", "formula", "obs/formula",
            "peak mem/rank", "note")
    body, footnotes = [], []
    for r in rows:
        diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}"
        mark = {"training": "", "collective": " ‡", "update rule": " †", "bitwise": " ≡"}.get(r.kind, " ?")
        ref = ""
        if notes and r.note:
            footnotes.append(r.note)
            ref = f"[{len(footnotes)}]"
        said = ("bitwise" if r.kind == "bitwise" else "yes") if r.matches else "NO"
        body.append((r.strategy, str(r.world_size), f"{said} ({diff}){mark}",
                     _fmt_bytes(r.bytes_sent_per_rank), _fmt_bytes(r.bytes_observed_per_rank),
                     _fmt_bytes(r.bytes_formula), _ratio(r), _fmt_bytes(r.peak_bytes_per_rank), ref))
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(tuple("-" * w for w in widths))] + [line(b) for b in body]
    out.append("")
    out.append("≡ bitwise: torch.equal to one device, both in the invariant mode;  "
               "‡ one collective, compared with the same result computed on one process;  † compared with its "
               "own (asynchronous) update rule, not with synchronous training;  ! observed bytes differ from "
               f"the formula by more than the protocol allowance ({OVERHEAD_PER_CALL} B per call + 1 %): the "
               "note says why.  model = minipar.comm's log; observed = bytes written to the sockets "
               "(minipar.wire, /proc/self/io).")
    if footnotes:
        out.append("")
        out += [f"[{i}] {text}" for i, text in enumerate(footnotes, 1)]
    return "\n".join(out)


def headline(rows) -> str:
    """What the tour showed, counted by what each row compares."""
    parts = []
    for kind, what in (("training", "training runs equal one device (losses and parameters)"),
                       ("collective", "collectives equal the one-process result"),
                       ("update rule", "asynchronous runs equal their own update rule"),
                       ("bitwise", "invariant-mode runs equal one device bit for bit")):
        mine = [r for r in rows if r.kind == kind]
        if mine:
            parts.append(f"{sum(r.matches for r in mine)} of {len(mine)} {what}")
    other = [r for r in rows if r.kind not in KINDS]
    if other:
        parts.append(f"{sum(r.matches for r in other)} of {len(other)} rows of unknown kind match")
    multi = [r for r in rows if r.world_size > 1 and (r.bytes_sent_per_rank is not None
                                                       or r.bytes_formula is not None)]
    seen = [r for r in multi if r.bytes_observed_per_rank is not None]
    status = [observed_status(r) for r in seen]
    parts.append(f"bytes observed on the wire for {len(seen)} of {len(multi)} rows that communicate: "
                 f"{status.count('within')} within protocol overhead of the formula, "
                 f"{status.count('differs')} not (each says why in its note)"
                 + (f", {status.count(None)} without a formula" if None in status else "")
                 + (f"; not observed: {', '.join(r.strategy for r in multi if r not in seen)}"
                    if len(seen) < len(multi) else ""))
    bad = [r.strategy for r in rows if not r.matches]
    return ";\n".join(parts) + (f"\nNOT matching: {', '.join(bad)}" if bad else "")


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m minipar tour", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per row")
    parser.add_argument("-k", dest="select", help="only strategies whose name contains this")
    parser.add_argument("--trace", metavar="DIR", help="save each row's trace as DIR/<row>.json (minipar.machine.trace)")
    args = parser.parse_args(argv)
    rows = run_tour(args.select, trace_dir=args.trace)
    if args.json:
        print(json.dumps([{**asdict(r), "observed_status": observed_status(r)} for r in rows], indent=1))
    else:
        print(format_table(rows))
        print()
        print(headline(rows))
    return 0 if all(r.matches for r in rows) else 1

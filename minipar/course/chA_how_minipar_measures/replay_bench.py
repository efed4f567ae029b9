"""``python -m minipar bench replay [--runs N] [--json]``: each strategy measured here, its own trace replayed
here and on a DGX-A100 node, the planner beside them — how well a replay predicts this machine.

Every run trains the eight strategies of :func:`.calibration.step_layouts` one after the other on n ranks (one
per core), each traced with its optimizer steps stamped and marked (:func:`minipar.observe.measure.timed_steps`);
``runs`` such rounds alternate the strategies, so that whatever else the machine
does falls on all of them alike. Per strategy and run, each a median over the run's steps, the slowest
rank's step:

* **measured** — the wall clock from one optimizer step to the next;
* **replay here** — the same run's trace played on this machine (:func:`minipar.machine.replay.replay`): compute
  is each segment's thread CPU seconds; each collective costs what gloo's own op costs here on average,
  timed at a few sizes at the start of the same round and fitted, a message what a ping-pong costs on
  average (:func:`.calibration.op_links`, :func:`.calibration.collective_times`);
* beside it, to say what a miss is made of: the replay with **one link** for every call (gloo's all-reduce
  fitted: the planner's link); with **+ threads**, each segment also paying the CPU its rank's other
  threads (gloo's) used meanwhile; and with **wall-clock compute** (the time a segment took on the clock:
  time lost on shared cores to other processes too);
* **engine** — the replay engine's own check: each segment its wall seconds and each blocking collective as
  long as it took in that run (:func:`minipar.machine.fidelity.observed_calls`; asynchronous calls and
  messages on the fitted links): nothing is a model but how the engine composes them — waits, overlap, the
  order of calls. Within ±:data:`ENGINE_TOLERANCE` of measured it says the engine plays the run as it happened;
* **replay on a DGX-A100 node** (a model): a separate round of the same programs traced with their operators
  counted (:mod:`minipar.observe.opcount`), played on :func:`minipar.machine.cluster.a100_cluster` — each
  operator priced on the A100 card (roofline + launch floor, :mod:`minipar.machine.device`), each call on
  NVLink. One number per strategy (the same in every run: a model has no run-to-run spread);
* **planner** (:func:`minipar.plan.estimate`) here (the calibrated cluster) and on the DGX node, without
  overlap and with ``overlap="minipar"`` (what this course's programs hide under compute: :mod:`minipar.plan.overlap`).
  Its cluster has one link (gloo's all-reduce, fitted): :class:`minipar.plan.Cluster` takes one α-β pair per
  level, not the replay's per-op :class:`minipar.machine.fidelity.OpLinks`.

Over the runs: the median and the spread (min–max) of every number and of predicted/measured; the ranking of
the strategies by each column, and :data:`AGREEMENTS` — each a :func:`minipar.plan.rank_agreement` (Kendall's
τ-b, both orders, both picks, the pick's gap) of one column against another: the planner's check is the planner
(with overlap) against the replay on the same cluster (here: the replay on the planner's one link), here and on
the DGX node; beside τ-b, the same pairs counted only outside the run-to-run spread
(:func:`.time_model.ranking_outside_spread`: ties left out, Goodman and Kruskal's γ). Where the picks differ,
``pick_ahead_runs`` counts the runs in which the observed column put the predicted pick at or ahead of the
observed best (each run is one round of all strategies: paired), ``pick_within_spread`` that it did so at
least once (the order of the two is then not settled by these runs).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

from minipar.launcher import launch
from minipar.machine.cluster import a100_cluster, comm_seconds
from minipar.machine.fidelity import observed_calls, wall_compute, with_other_threads
from minipar.observe.measure import gather_steps, timed_steps
from minipar.machine.replay import replay
from minipar.machine.trace import Trace
from minipar.plan import agreement_text, estimate, rank_agreement

from .calibration import STEP_MODEL, calibrate, calibrated_cluster, collective_times, op_links, planner_options, \
    step_layouts, step_recipe, train
from .time_model import ranking_outside_spread

__all__ = ["REPLAY_STRATEGIES", "TOLERANCE", "ENGINE_TOLERANCE", "AGREEMENTS", "fidelity_table", "format_table", "agreements_text",
           "main"]

REPLAY_STRATEGIES = tuple(step_layouts(2))
TOLERANCE = 0.15                     # the goal: predicted within ±15 % of measured
ENGINE_TOLERANCE = 0.10              # the engine's own check (everything as it happened, replayed): ±10 %
# name: (predicted column, observed column) of each ranking check (plan.rank_agreement)
AGREEMENTS = {
    "planner vs replay, here": ("planner_here_overlap", "replay_here_one_link"),   # the planner's own link
    "planner vs replay, DGX-A100": ("planner_dgx_a100_overlap", "replay_dgx_a100"),
    "planner (no overlap) vs replay, here": ("planner_here", "replay_here_one_link"),
    "replay vs measured, here": ("replay_here", "measured"),
    "planner vs measured, here": ("planner_here_overlap", "measured"),
}


def _rounds(rank, world_size, names, steps, runs):
    """On each rank: ``runs`` rounds of {name: RankSteps (stamps, trace)}, each round beginning with gloo's
    collectives timed (:func:`.calibration.collective_times`, under the key "links"), and one more round traced
    with the operators counted (for the replay on the A100 card; its times unused: counting slows every op)."""
    out = []
    for _ in range(runs):
        one = {"links": collective_times(world_size)}
        for name in names:
            with timed_steps(rank) as one[name]:
                train(rank, world_size, name, one[name].stamped(step_recipe(steps)))
        out.append(one)
    counted = {}
    for name in names:
        with timed_steps(rank, ops=True) as counted[name]:
            train(rank, world_size, name, counted[name].stamped(step_recipe(steps)))
    return out, {name: run.trace for name, run in counted.items()}


def _spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def _replays(trace, cal, n):
    """{column: seconds per step (median over the run's steps)} of one run's trace."""
    here, links = calibrated_cluster(cal, n), op_links(cal, n)
    per_op = {"comm_time": links} if links is not None else {}
    played = {"replay_here": replay(trace, here, compute_scale=1.0, **per_op),
              "replay_here_one_link": replay(trace, here, compute_scale=1.0),
              "replay_here_threads": replay(with_other_threads(trace), here, compute_scale=1.0, **per_op),
              "replay_here_wall": replay(wall_compute(trace), here, compute_scale=1.0, **per_op),
              "replay_here_calls_seen": replay(trace, here, compute_scale=1.0,
                                               comm_time=observed_calls(trace, links or comm_seconds)),
              "replay_here_engine": replay(wall_compute(trace), here, compute_scale=1.0,
                                           comm_time=observed_calls(trace, links or comm_seconds))}
    return {k: statistics.median(r.step_gaps("step")) for k, r in played.items()}


def _miss(row) -> str | None:
    """Why a replay here misses measured by more than :data:`TOLERANCE`, generated from the row's medians: its
    sign (too short: the replay lacks time; too long: it charges more than the run took) and the first column
    that lands within the tolerance, which names the term (None: no miss)."""
    ratio = row["ratio_replay_here"]["median"]
    if abs(ratio - 1) <= TOLERANCE:
        return None
    closers = (("replay_here_threads", "the CPU the rank's communication threads used during compute (+ threads)"),
               ("replay_here_wall", "time lost on shared cores to other processes or gloo's threads (wall-clock "
                                    "compute)"),
               ("replay_here_calls_seen", f"the calls cost {'more' if ratio < 1 else 'less'} inside the step than "
                                          f"calibrated (calls as seen)"),
               ("replay_here_engine", "wall-clock compute and the calls as they took, together (the engine check)"))
    head = (f"too short (x{ratio:.2f}): the replay lacks time" if ratio < 1 else
            f"too long (x{ratio:.2f}): the replay charges more than the run took")
    for column, what in closers:
        if abs(row[f"ratio_{column}"]["median"] - 1) <= TOLERANCE:
            return f"{head}; {what} closes it (x{row[f'ratio_{column}']['median']:.2f})"
    return f"{head}; no column closes it: communication and waiting the columns do not explain"


def fidelity_table(cal: dict, names=REPLAY_STRATEGIES, steps: int = 4, runs: int = 5) -> dict:
    """Measure and replay ``names`` (default the eight) ``runs`` times on ``cal["ranks"]`` ranks: {"rows":
    one dict per strategy (each column's median/min/max over runs, "ratio_<column>" = predicted / measured
    per run, "miss", "planner_<where>_overlap_terms": the estimate's time terms, "calls_per_step"), "rankings",
    "picks", "agreements", "tau"} (see the module's docstring)."""
    if steps < 2 or runs < 1:
        raise ValueError(f"need steps ≥ 2 (a step is the gap between two optimizer steps) and runs ≥ 1, got "
                         f"steps={steps}, runs={runs}")
    n, layouts = cal["ranks"], step_layouts(cal["ranks"])
    unknown = [name for name in names if name not in layouts]
    if unknown:
        raise ValueError(f"no strategy {unknown}; strategies: {list(layouts)}")
    per_rank = launch(_rounds, n, list(names), steps, runs, quiet=True)
    rows = []
    for name in names:
        columns: dict = {}
        # the operators on the A100 card, from the counted round: a model, one number for every run
        dgx = statistics.median(replay(Trace([r[1][name] for r in per_rank]), a100_cluster(1)).step_gaps("step"))
        for run in range(runs):
            measured = gather_steps([r[0][run][name] for r in per_rank], {"flops_per_second": cal["flops"]})
            trace = measured.trace
            links = {k: statistics.fmean(r[0][run]["links"][k] for r in per_rank) for k in per_rank[0][0][run]["links"]}
            values = {"measured": measured.median, **_replays(trace, {**cal, **links}, n), "replay_dgx_a100": dgx}
            for k, v in values.items():
                columns.setdefault(k, []).append(v)
        row = {"name": name, "layout": str(layouts[name]), "ranks": n}
        row.update({k: _spread(v) for k, v in columns.items()})
        row.update({f"ratio_{k}": _spread([p / m for p, m in zip(v, columns["measured"])])
                    for k, v in columns.items() if k.startswith("replay_here")})
        kw = planner_options(layouts[name])
        for where, cluster in (("here", calibrated_cluster(cal, n)), ("dgx_a100", a100_cluster(1))):
            for suffix, overlap in (("", False), ("_overlap", "minipar")):
                e = estimate(STEP_MODEL, cluster, layouts[name], overlap=overlap, **kw)
                row[f"planner_{where}{suffix}"] = e.step_seconds
            row[f"planner_{where}_overlap_terms"] = {k: v for k, v in e.time.items() if k != "total"}
        # communication calls per step of the busiest rank (the whole run's trace / steps: set-up included)
        row["calls_per_step"] = max(len(r.comms()) for r in trace.ranks) / steps
        row["ratio_planner_here"] = row["planner_here"] / row["measured"]["median"]
        row["ratio_planner_here_overlap"] = row["planner_here_overlap"] / row["measured"]["median"]
        row["miss"] = _miss(row)
        rows.append(row)
    return {"rows": rows, **_rankings(rows), "ranks": n, "runs": runs, "steps": steps}


def _value(row, column) -> float:
    """A row's seconds per step in ``column``: the median over the runs, or the planner's one number."""
    v = row[column]
    return v["median"] if isinstance(v, dict) else v


def _rankings(rows) -> dict:
    """{"rankings": {column: names fastest first}, "picks": {column: the fastest}, "agreements": {name of
    :data:`AGREEMENTS`: plan.rank_agreement + "pick_within_spread"}, "tau": {name: τ-b}}."""
    columns = ["measured", "replay_here", "replay_here_one_link", "planner_here", "planner_here_overlap", "replay_dgx_a100",
               "planner_dgx_a100", "planner_dgx_a100_overlap"]
    rankings = {k: [r["name"] for r in sorted(rows, key=lambda r: _value(r, k))] for k in columns}
    agreements = {}
    if len(rows) > 1:
        by_name = {r["name"]: r for r in rows}
        for label, (predicted, observed) in AGREEMENTS.items():
            a = rank_agreement({r["name"]: _value(r, predicted) for r in rows},
                               {r["name"]: _value(r, observed) for r in rows})
            a["columns"] = [predicted, observed]
            a["pick_ahead_runs"] = _runs_ahead(by_name[a["predicted_pick"]][observed],
                                               by_name[a["observed_pick"]][observed])
            a["pick_within_spread"] = a["pick_ahead_runs"] > 0
            a["runs"] = len(by_name[a["observed_pick"]][observed]["runs"])
            tie_aware = ranking_outside_spread({r["name"]: r[predicted] for r in rows},
                                               {r["name"]: r[observed] for r in rows})
            a["outside_spread"] = {**tie_aware, **{k: [list(p) for p in tie_aware[k]] for k in ("tied", "swapped")},
                                   "gamma": None if math.isnan(tie_aware["gamma"]) else tie_aware["gamma"]}  # JSON
            agreements[label] = a
    return {"rankings": rankings, "picks": {k: v[0] for k, v in rankings.items()}, "agreements": agreements,
            "tau": {k: a["tau"] for k, a in agreements.items()}}


def _runs_ahead(pick, best) -> int:
    """In how many runs (the same round for both: paired) the column put ``pick`` at or ahead of ``best``;
    more than 0 while ``best`` wins on the median: the order of the two is not settled by these runs.
    A planner column (one number, no runs) counts 0."""
    if not isinstance(pick, dict):
        return 0
    return sum(p <= b for p, b in zip(pick["runs"], best["runs"]))


def format_table(table: dict, agreements: bool = True, rankings: bool = True) -> str:
    """The table as text: ms per step, median [min–max] over the runs; ratios predicted / measured; the engine
    check; with ``rankings``, each column's order by its medians; with ``agreements``, :func:`agreements_text`."""
    ms = lambda s: f"{s['median'] * 1e3:6.1f} [{s['min'] * 1e3:.0f}–{s['max'] * 1e3:.0f}]"  # noqa: E731
    x = lambda s: f"{s['median']:4.2f} [{s['min']:.2f}–{s['max']:.2f}]"  # noqa: E731
    lines = [f"{table['ranks']} ranks, {table['runs']} runs of {table['steps']} steps; ms per step, median "
             f"[min–max] over the runs; ratio = predicted / measured",
             f"{'':8}{'measured':>18}  {'replay here':>18} {'ratio':>16}  {'one link':>8} {'+thr.':>6} {'wall':>6} "
             f"{'seen':>5} {'engine':>17}  "
             f"{'planner':>8} {'ratio':>5} {'overlap':>7}  | DGX-A100 model (ms): replay, planner, with overlap"]
    for r in table["rows"]:
        dgx = f"{r['replay_dgx_a100']['median'] * 1e3:.3f}"
        lines.append(f"{r['name']:8}{ms(r['measured']):>18}  {ms(r['replay_here']):>18} {x(r['ratio_replay_here']):>16}  "
                     f"{r['ratio_replay_here_one_link']['median']:8.2f} {r['ratio_replay_here_threads']['median']:6.2f} "
                     f"{r['ratio_replay_here_wall']['median']:6.2f} {r['ratio_replay_here_calls_seen']['median']:5.2f} "
                     f"{x(r['ratio_replay_here_engine']):>17}  "
                     f"{r['planner_here'] * 1e3:8.1f} {r['ratio_planner_here']:5.2f} "
                     f"{r['planner_here_overlap'] * 1e3:7.1f}  | {dgx}, "
                     f"{r['planner_dgx_a100'] * 1e3:.3f}, {r['planner_dgx_a100_overlap'] * 1e3:.3f}" + (f"   miss: {r['miss']}" if r["miss"] else ""))
    engine = [r["name"] for r in table["rows"] if abs(r["ratio_replay_here_engine"]["median"] - 1) <= ENGINE_TOLERANCE]
    lines.append(f"engine check (wall compute, blocking calls as they took): {len(engine)} of {len(table['rows'])} "
                 f"within ±{ENGINE_TOLERANCE:.0%} of measured (medians)")
    for k, order in table["rankings"].items() if rankings else ():
        lines.append(f"ranking by {k:24}: {' < '.join(order)}")
    return "\n".join(lines + ([agreements_text(table)] if agreements else []))


def agreements_text(table: dict, names=None) -> str:
    """:data:`AGREEMENTS` (default all) printed with :func:`minipar.plan.agreement_text`: per strategy the
    two columns in ms and their ratio, Kendall's τ-b, the picks; where they differ, whether within the spread."""
    out = []
    for label in names or table["agreements"]:
        a = table["agreements"][label]
        predicted, observed = a["columns"]
        small = max(r["observed"] for r in a["rows"]) < 1e-2           # a DGX step: microseconds
        short = [c.split("_")[0] for c in (predicted, observed)]       # planner / replay / measured
        out += ["", f"{label} ({predicted} against {observed}):",
                agreement_text(a, *((1e-6, "us") if small else (1e-3, "ms")), labels=short)]
        g = a["outside_spread"]
        out.append(f"  counted outside the run-to-run spread: {g['concordant']} pairs in order, {g['discordant']} "
                   f"swapped, {len(g['tied'])} tied of {g['pairs']}"
                   + (f"; gamma {g['gamma']:+.2f}" if g["concordant"] + g["discordant"] else "; no pair apart"))
        if not a["picks_agree"]:
            k, runs = a["pick_ahead_runs"], a["runs"]
            out.append(f"  {short[1]}: {a['predicted_pick']} at or ahead of {a['observed_pick']} in {k} of {runs} runs"
                       + (" — the gap is inside the run-to-run spread" if k else " — beyond the run-to-run spread"))
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar bench replay")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--runs", type=int, default=5, help="rounds of all strategies (default 5; median, spread)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per strategy and run (default 4)")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.runs < 1:            # a step is the gap between two optimizer steps
        parser.error(f"--steps must be at least 2 and --runs at least 1, got {args.steps} and {args.runs}")
    cal = calibrate()
    table = fidelity_table(cal, steps=args.steps, runs=args.runs)
    if args.json:
        print(json.dumps({"calibration": {k: v for k, v in cal.items() if k != "samples"}, **table}, indent=1))
    else:
        print(format_table(table))
    return 0

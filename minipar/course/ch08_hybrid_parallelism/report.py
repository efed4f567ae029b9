"""Chapter 08's printed tables, each one value: a :class:`minipar.course.report.Report` whose text the cell
prints and whose ``check()`` asserts what the chapter's sentences say about its numbers."""
from __future__ import annotations

from minipar.course.report import Report
from minipar.hybrid.parallel3d import bytes_formula
from minipar.pipeline.schedules import bubble_formula
from minipar.pipeline.timeline import measured_idle_fraction, step_rows, typical_step


__all__ = ["bytes_by_kind", "bubble", "bubble_sentence", "zero_per_microbatch", "zero_once_per_step"]


def _check_bytes(r: Report) -> None:
    for run, f in zip(r.runs, r.formulas):
        assert run.bytes_by_kind == {k: f[k] for k in run.bytes_by_kind}           # log = formula, every kind
        assert run.observed["dp"] >= run.bytes_by_kind["dp"]
    assert r.dp_bytes > r.pp_bytes                                                 # DP moves more than PP here


def bytes_by_kind(runs: list, cfg, *, batch: int, seq: int, dp: int, pp: int, tp: int, m: int) -> Report:
    """§3: bytes each rank sent per step by kind (communication log) beside ``bytes_formula``, and what the
    sockets took (observed, per window: DP; PP + TP); then rank 0's DP against its PP bytes."""
    formulas = [bytes_formula(cfg, batch=batch, seq=seq, dp=dp, pp=pp, tp=tp, m=m, pp_rank=r.coords["pp"]) for r in runs]
    lines = [f"{'rank':>4} {'coords':>11} | {'DP':>8} {'(formula)':>9} | {'PP':>7} {'(formula)':>9} | "
             f"{'TP':>8} {'(formula)':>9} | observed DP, PP+TP"]
    for rank, (r, f) in enumerate(zip(runs, formulas)):
        b, at = r.bytes_by_kind, " ".join(f"{d}{r.coords[d]}" for d in ("dp", "pp", "tp"))
        lines.append(f"{rank:>4} {at:>11} | {b['dp']:>8.0f} {f['dp']:>9.0f} | {b['pp']:>7.0f} {f['pp']:>9.0f} | "
                     f"{b['tp']:>8.0f} {f['tp']:>9.0f} | {r.observed['dp']:.0f}, {r.observed['pp+tp']:.0f}")
    dp_bytes, pp_bytes = runs[0].bytes_by_kind["dp"], runs[0].bytes_by_kind["pp"]
    lines.append(f"rank 0 per step: DP {dp_bytes:.0f} B, PP {pp_bytes:.0f} B  (DP/PP = {dp_bytes / pp_bytes:.1f})")
    return Report("\n".join(lines), _check_bytes, runs=runs, formulas=formulas, dp_bytes=dp_bytes, pp_bytes=pp_bytes)


def _check_bubble(r: Report) -> None:
    assert r.formula - 1e-12 <= r.unequal          # unequal stages can only widen the bubble
    assert r.wait_shown >= 0                       # a waiting time is never printed negative


def bubble(runs: list, *, p: int, m: int, noise: float = 0.01) -> Report:
    """§3: one pipeline's bubble (dp = tp = 0) in its typical step, measured, beside the formula (p−1)/(m+p−1)
    and beside a model fed by the run's own stage times, 1 − m·Σt_i / (p·(Σt_i + (m−1)·max t_i)); the sentence
    that splits the gap is generated from the three numbers. What is left after unequal stages is time spent
    waiting in receives; a negative remainder is no negative wait but the step's stage times differing from
    the averages the model used, and is said so."""
    one_pipeline = [r for r in runs if r.coords["dp"] == 0 and r.coords["tp"] == 0]
    step = typical_step(one_pipeline)
    rows = step_rows(one_pipeline, step)
    per_stage = [sum(t1 - t0 for _, _, st, _, t0, t1 in rows if st == stage) / m for stage in range(p)]
    formula = bubble_formula("1f1b", p, m)
    unequal = 1 - m * sum(per_stage) / (p * (sum(per_stage) + (m - 1) * max(per_stage)))
    measured = measured_idle_fraction(one_pipeline, step)
    where = ("above" if measured > formula + noise else "below" if measured < formula - noise else
             f"within {noise} of")
    rest, wait_shown = bubble_sentence(formula, unequal, measured, noise)
    lines = [f"F + BW per micro-batch (step {step + 1}): " + ", ".join(
                 f"stage {i} {t * 1e3:.1f} ms" for i, t in enumerate(per_stage)) +
             f" (ratio {per_stage[-1] / per_stage[0]:.2f})",
             f"bubble of one pipeline: formula (p−1)/(m+p−1) (equal stages) {formula:.2f}; model with the measured "
             f"stage times {unequal:.2f}; measured {measured:.2f}, {where} the formula", rest]
    return Report("\n".join(lines), _check_bubble, step=step, per_stage=per_stage, formula=formula, unequal=unequal,
                  measured=measured, wait_shown=wait_shown)


def bubble_sentence(formula: float, unequal: float, measured: float, noise: float = 0.01) -> tuple:
    """(the sentence splitting measured − formula into unequal stages and waiting, the waiting shown ≥ 0). What
    is left after unequal stages is time spent waiting in receives; a remainder below −``noise`` is no negative
    wait but this step's stage times differing from the averages the model used, and the sentence says so."""
    wait = measured - unequal
    if wait >= -noise:
        shown = max(wait, 0.0)
        rest = (f"waiting in receives (transfers, and other ranks' turn on the shared cores) for the remaining "
                f"{shown:.2f}" if shown > noise else f"nothing measurable (under {noise}) is left for waiting in receives")
    else:
        shown = 0.0
        rest = (f"the measurement is {-wait:.2f} below the model with unequal stages: this step's stage times are not "
                f"the averages the model used (noise, not a negative wait)")
    return (f"of the {measured - formula:+.2f} between formula and measurement, unequal stages account for "
            f"{unequal - formula:+.2f}; " + rest, shown)


def _check_per_microbatch(r: Report) -> None:
    assert r.rs[2] == r.m * r.rs[1] and r.per_mb[2]["by_op"]["reduce_scatter"][0] == r.m   # m calls, m× the bytes


def zero_per_microbatch(result: dict, m: int) -> Report:
    """§5: ZeRO-1/2/3 run per micro-batch inside the pipeline (:func:`.measure.zero_with_pipeline`'s
    "per_microbatch"): collectives and bytes over the dp group in one step, rank 0's view."""
    per_mb = result["per_microbatch"]
    lines = [f"ZeRO-{z}: {c['calls']:>2} collectives over dp per step, {c['bytes']:>7} bytes  {c['by_op']}"
             for z, c in per_mb.items()]
    rs = {z: per_mb[z]["by_op"]["reduce_scatter"][1] for z in (1, 2)}
    return Report("\n".join(lines), _check_per_microbatch, per_mb=per_mb, rs=rs, m=m)


def _check_once(r: Report) -> None:
    once = r.once
    assert all(c["matches"] for c in once.values())
    assert once[2]["calls"] == once[3]["calls"] == once[1]["calls"] and once[3]["bytes"] == once[1]["bytes"] == r.rs1 * 2
    assert once[3]["between"] < once[2]["between"] < once[1]["between"] and once[3]["peak"] > once[1]["peak"]


def zero_once_per_step(result: dict) -> Report:
    """§5: ZeRO-1/2/3 as the 3D trainer runs them, once per step (:func:`.measure.zero_with_pipeline`'s "once"):
    equal to one device, collectives and bytes over dp, model states between steps, the step's peak (rank 0)."""
    once = result["once"]
    lines = [f"ZeRO-{z} once per step: equal to one device {c['matches']}; {c['calls']:.0f} collectives over dp per "
             f"step, {c['bytes']:,.0f} bytes; model states between steps {c['between']:,} B, the step's peak {c['peak']:,} B"
             for z, c in once.items()]
    rs1 = result["per_microbatch"][1]["by_op"]["reduce_scatter"][1]
    return Report("\n".join(lines), _check_once, once=once, rs1=rs1)

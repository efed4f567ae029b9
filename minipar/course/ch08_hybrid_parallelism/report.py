"""Chapter 08's printed tables, each one value: a :class:`minipar.course.report.Report` whose text the cell
prints and whose ``check()`` asserts what the chapter's sentences say about its numbers."""
from __future__ import annotations

from minipar.course.report import Report
from minipar.hybrid.parallel3d import bytes_formula
from minipar.pipeline.schedules import bubble_formula
from minipar.pipeline.timeline import measured_idle_fraction, step_rows, typical_step


__all__ = ["bytes_by_kind", "bubble", "bubble_table", "zero_per_microbatch", "zero_once_per_step", "step_source"]


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


def bubble(runs: list, *, p: int, m: int) -> Report:
    """§3: one pipeline's bubble (dp = tp = 0) in its typical step, measured, beside the formula (p−1)/(m+p−1)
    and beside a model fed by the run's own stage times, 1 − m·Σt_i / (p·(Σt_i + (m−1)·max t_i)), as a table
    (:func:`bubble_table`)."""
    one_pipeline = [r for r in runs if r.coords["dp"] == 0 and r.coords["tp"] == 0]
    step = typical_step(one_pipeline)
    rows = step_rows(one_pipeline, step)
    per_stage = [sum(t1 - t0 for _, _, st, _, t0, t1 in rows if st == stage) / m for stage in range(p)]
    formula = bubble_formula("1f1b", p, m)
    unequal = 1 - m * sum(per_stage) / (p * (sum(per_stage) + (m - 1) * max(per_stage)))
    measured = measured_idle_fraction(one_pipeline, step)
    return Report(bubble_table(formula, unequal, measured, per_stage, step), _check_bubble, step=step,
                  per_stage=per_stage, formula=formula, unequal=unequal, measured=measured)


def bubble_table(formula: float, unequal: float, measured: float, per_stage: list, step: int) -> str:
    """The three bubbles of one pipeline as a small table (idle share of the step), under the stages' measured
    F + BW time per micro-batch (seconds in ``per_stage``; ``step`` counted from 0)."""
    stages = ", ".join(f"stage {i} {t * 1e3:.1f} ms" for i, t in enumerate(per_stage))
    slow = max(range(len(per_stage)), key=per_stage.__getitem__)
    slower = f"slowest stage in this run: stage {slow}, {per_stage[slow] / min(per_stage):.2f}× the fastest"
    rows = [("formula (p−1)/(m+p−1): equal stages, free transfers", formula),
            ("model with the measured stage times", unequal), ("measured", measured)]
    return "\n".join([f"one pipeline (dp 0, tp 0), step {step + 1}; F + BW per micro-batch: {stages}",
                      slower, f"{'bubble':52} {'idle share':>10}"] + [f"{name:52} {x:>10.2f}" for name, x in rows])


def _check_per_microbatch(r: Report) -> None:
    assert r.rs[2] == r.m * r.rs[1] and r.per_mb[2]["by_op"]["reduce_scatter"][0] == r.m   # m calls, m× the bytes
    assert r.per_mb[2]["by_op"]["all_gather"] == r.per_mb[1]["by_op"]["all_gather"]    # + the step's all-gather
    assert 2 * r.per_mb[2]["bytes"] == (r.m + 1) * r.per_mb[1]["bytes"]                 # (m+1)/2 × ZeRO-1's bytes


def zero_per_microbatch(result: dict, m: int) -> Report:
    """§5: ZeRO-1/2/3 run per micro-batch inside the pipeline (:func:`.measure.zero_with_pipeline`'s
    "per_microbatch"): collectives and bytes over the dp group in one whole step (forwards, backwards and the
    all-gather after the optimizer step), rank 0's view, and each one's bytes in ZeRO-1's."""
    per_mb = result["per_microbatch"]
    lines = [f"ZeRO-{z}: {c['calls']:>2} collectives over dp per step, {c['bytes']:>7} bytes "
             f"({c['bytes'] / per_mb[1]['bytes']:.1f}× ZeRO-1's)  {c['by_op']}" for z, c in per_mb.items()]
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


# The branches of Trainer3D.step for what chapter 08 does not teach (context parallelism, ZeRO-3's gather, the
# invariant mode, mixture of experts), each named by its first line; their bodies go with them.
_UNTAUGHT = ("@in_own_mode", "if self.positions is not None:", "if self.zero_stage == 3:", "if self.mb_grads:",
             "if self.experts and self.layout.tp > 1:", "if self.experts:", "# float64: mean_over_ranks",
             "# gave, which the float holds exactly")


def step_source() -> str:
    """The source of :meth:`minipar.hybrid.parallel3d.Trainer3D.step`, read live, with the branches chapter 08
    does not teach left out (:data:`_UNTAUGHT`; the ``elif`` after a dropped ``if`` becomes ``if``). Raises
    ValueError when one of them is no longer in the step, so the shown step cannot drift from the real one."""
    import inspect
    from minipar.hybrid.parallel3d import Trainer3D

    lines = inspect.getsource(Trainer3D.step).splitlines()
    missing = [m for m in _UNTAUGHT if not any(line.strip().startswith(m) for line in lines)]
    if missing:
        raise ValueError(f"Trainer3D.step no longer has {missing}: update chapter 08's step_source")
    kept, drop_deeper_than, dropped_if_at = [], None, None
    for line in lines:
        indent, text = len(line) - len(line.lstrip()), line.strip()
        if drop_deeper_than is not None and (indent > drop_deeper_than or not text):
            continue
        drop_deeper_than = None
        if any(text.startswith(m) for m in _UNTAUGHT):
            drop_deeper_than, dropped_if_at = indent, (indent if text.startswith("if ") else None)
            continue
        if dropped_if_at == indent and text.startswith("elif "):
            line = line.replace("elif ", "if ", 1)
        dropped_if_at = None if dropped_if_at != indent else dropped_if_at
        kept.append(line)
    return "\n".join(kept)

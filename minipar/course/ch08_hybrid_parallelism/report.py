"""Chapter 08's printed tables, each one value: a :class:`minipar.course.report.Report` whose text the cell
prints and whose ``check()`` asserts what the chapter's sentences say about its numbers; :func:`show` does both,
so a cell that shows a table is one call. Pictures with their claims: :func:`draw_mesh`, :func:`show_memory`."""
from __future__ import annotations

from minipar.course.ch08_hybrid_parallelism import claims, figures, measure
from minipar.course.report import Report
from minipar.hybrid.parallel3d import bytes_formula, validate
from minipar.pipeline.schedules import bubble_formula
from minipar.pipeline.timeline import measured_idle_fraction, step_rows, typical_step


__all__ = ["show", "draw_mesh", "layout_name", "global_batch", "bytes_by_kind", "bubble", "bubble_table", "show_memory",
           "kinds_at_scale", "qkv_bias_gradient", "zero_table",
           "show_checkpoint", "show_refusals"]


def show(report: Report) -> None:
    """Print a table and check what the chapter says about its numbers (prints nothing more when all hold)."""
    print(report.text)
    report.check()


def draw_mesh(mesh, pp_outermost) -> None:
    """§1's picture: the 8 ranks of ``mesh`` (dp 2 × pp 2 × tp 2) with their groups; checks the groups printed,
    and that ``pp_outermost`` (the same sizes, PP outermost) keeps the TP groups and sends its pipelines across."""
    import matplotlib.pyplot as plt
    claims.check_mesh_groups(mesh)
    claims.check_tp_stays_neighbours_either_way(pp_outermost, mesh)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    figures.draw_mesh(ax)
    plt.show()


def layout_name(layout: dict) -> str:
    """'dp 2 × pp 8 × tp 1 (16 ranks), m = 8' for one of :data:`.measure.BAD_LAYOUTS`."""
    return (f"dp {layout['dp']} × pp {layout['pp']} × tp {layout['tp']} ({layout['world_size']} ranks), "
            f"m = {layout['micro_batches']}")


def global_batch(batch: int, seq: int, *, dp: int, m: int) -> Report:
    """§2: the global batch cut as B = dp × m × mb."""
    text = f"B = {batch} = dp {dp} × m {m} × mb {batch // (dp * m)};  sequence {seq} tokens"
    return Report(text, lambda r: claims.check_global_batch_loss(batch, dp, m))


def _check_bytes(r: Report) -> None:
    for run, f in zip(r.runs, r.formulas):
        assert run.bytes_by_kind == {k: f[k] for k in run.bytes_by_kind}           # log = formula, every kind
        assert run.observed["dp"] >= run.bytes_by_kind["dp"]
        same_stage = next(o for o in r.runs if o.coords["pp"] == run.coords["pp"])
        assert run.bytes_by_kind == same_stage.bytes_by_kind                       # one row per stage tells all
    assert r.dp_bytes > r.pp_bytes                                                 # DP moves more than PP here


def _same_as(runs: list, shown) -> str:
    """'ranks 1, 4, 5 send what rank 0 sends; …' for the ranks not shown, each against the shown rank of its
    stage (every kind equal: checked in :func:`_check_bytes`)."""
    by_stage = {runs[r].coords["pp"]: r for r in shown}
    rest = {r: [o for o in range(len(runs)) if o not in shown and runs[o].coords["pp"] == runs[r].coords["pp"]]
            for r in by_stage.values()}
    return "; ".join(f"ranks {', '.join(map(str, others))} send what rank {r} sends" for r, others in rest.items() if others)


def bytes_by_kind(runs: list, cfg, *, batch: int, seq: int, dp: int, pp: int, tp: int, m: int,
                  ranks=(0, 2)) -> Report:
    """§3: bytes ``ranks`` sent per step by kind (communication log) beside ``bytes_formula`` (checked, with
    the sockets carrying at least the log's DP bytes); which other ranks send the same (one row per stage by
    default). The check holds every rank, shown or not."""
    formulas = [bytes_formula(cfg, batch=batch, seq=seq, dp=dp, pp=pp, tp=tp, m=m, pp_rank=r.coords["pp"]) for r in runs]
    lines = [f"{'':>4} {'':>11} | {'DP':^18} | {'PP':^17} | {'TP':^18}",
             f"{'rank':>4} {'coords':>11} | {'log':>8} {'formula':>9} | {'log':>7} {'formula':>9} | "
             f"{'log':>8} {'formula':>9}"]
    for rank in ranks:
        r, f = runs[rank], formulas[rank]
        b, at = r.bytes_by_kind, " ".join(f"{d}{r.coords[d]}" for d in ("dp", "pp", "tp"))
        lines.append(f"{rank:>4} {at:>11} | {b['dp']:>8.0f} {f['dp']:>9.0f} | {b['pp']:>7.0f} {f['pp']:>9.0f} | "
                     f"{b['tp']:>8.0f} {f['tp']:>9.0f}")
    if len(ranks) < len(runs):
        lines.append(_same_as(runs, ranks))
    dp_bytes, pp_bytes = runs[0].bytes_by_kind["dp"], runs[0].bytes_by_kind["pp"]
    return Report("\n".join(lines), _check_bytes, runs=runs, formulas=formulas, dp_bytes=dp_bytes, pp_bytes=pp_bytes)


def _check_bubble(r: Report) -> None:
    assert r.formula - 1e-12 <= r.unequal          # unequal stages can only widen the bubble
    # the sentence under the table says the side the printed (rounded) numbers put the measurement on
    assert r.text.splitlines()[-1] == measured_against_model(r.unequal, r.measured)


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
    text = bubble_table(formula, unequal, measured, per_stage, step) + "\n" + measured_against_model(unequal, measured)
    return Report(text, _check_bubble, step=step, per_stage=per_stage, formula=formula, unequal=unequal,
                  measured=measured)


def measured_against_model(unequal: float, measured: float) -> str:
    """One sentence on which side of the model fed this run's stage times the measured idle share falls, read
    from the two numbers as the table prints them (two decimals), with what pushes it that way on shared cores.
    The measured share counts an action from the moment its input is there to its end; on 8 processes sharing
    2 cores that span also holds the time the process waited for a core."""
    a, b = f"{measured:.2f}", f"{unequal:.2f}"
    if a == b:
        return (f"Measured and modelled agree here ({a}); on shared cores that is partly luck (chapter 04's paced "
                f"runs separate the effects).")
    if measured < unequal:
        return (f"The measured share ({a}) is below the model's ({b}). Each span also holds the time its process "
                f"waited for one of the 2 cores, and a stage working alone (the fill and the drain) waits less, so "
                f"the actions at the bubble's edges run faster than the average stage time the model assumes.")
    return (f"The measured share ({a}) is above the model's ({b}): it also counts as idle what the model leaves "
            f"out, the time a message spends in transfer, a receiver waiting for a core before it sees its message, "
            f"and the work between actions (posting sends, bookkeeping).")


def bubble_table(formula: float, unequal: float, measured: float, per_stage: list, step: int) -> str:
    """The three bubbles of one pipeline as a small table (idle share of the step), under the stages' measured
    F + BW time per micro-batch (seconds in ``per_stage``; ``step`` counted from 0)."""
    stages = ", ".join(f"stage {i} {t * 1e3:.1f} ms" for i, t in enumerate(per_stage))
    rows = [("formula (p−1)/(m+p−1)", formula), ("with this run's stage times", unequal),
            ("measured here (not a schedule property)", measured)]
    return "\n".join([f"one pipeline (dp 0, tp 0), step {step + 1}; F + BW per micro-batch: {stages}",
                      f"{'bubble':40} {'idle share':>10}"] + [f"{name:40} {x:>10.2f}" for name, x in rows])


def _check_zero_table(r: Report) -> None:
    claims.check_zero_per_microbatch(r)
    claims.check_zero_once(r)
    assert r.llama3 == r.m * r.per_mb[1]["bytes"]          # no reshard after forward: m × ZeRO-1's bytes


def zero_table(result: dict, m: int) -> Report:
    """§5's one table (:func:`.measure.zero_with_pipeline`, rank 0, over its dp group, one step): ZeRO-1, then
    ZeRO-2/3 per micro-batch and once per step: reduce-scatters and all-gathers (calls), bytes sent, bytes in
    ZeRO-1's, and for the trainer's runs (ZeRO-1, once per step) the model states held between steps and the
    step's measured peak; then ZeRO-3 without resharding after forward (Llama 3), counted from the per-micro-batch
    ZeRO-3 row: its reduce-scatters, and the forward's half of its all-gathers (not run). Each run's equality
    with one device is checked (:func:`.claims.check_zero_once`)."""
    per_mb, once = result["per_microbatch"], result["once"]
    one = per_mb[1]["bytes"]
    (rs3, rs3_bytes), (ag3, ag3_bytes) = per_mb[3]["by_op"]["reduce_scatter"], per_mb[3]["by_op"]["all_gather"]
    llama3 = {"by_op": {"reduce_scatter": (rs3, rs3_bytes), "all_gather": (ag3 // 2, ag3_bytes / 2)},
              "bytes": rs3_bytes + ag3_bytes / 2}
    lines = [f"{'':33} {'reduce-scatters':>15} {'all-gathers':>11} {'bytes sent':>10} {'× ZeRO-1':>8} "
             f"{'held between steps':>18} {'step peak':>10}"]
    rows = [("ZeRO-1", per_mb[1], once[1]), ("ZeRO-2, per micro-batch", per_mb[2], None),
            ("ZeRO-3, per micro-batch", per_mb[3], None), ("ZeRO-2, once per step", None, once[2]),
            ("ZeRO-3, once per step", None, once[3]), ("ZeRO-3, no reshard after forward*", llama3, None)]
    for name, calls, run in rows:
        ops = (calls or per_mb[1])["by_op"]           # once per step: ZeRO-1's calls (checked equal)
        sent = calls["bytes"] if calls else run["bytes"]
        held, peak = (f"{run['between']:,} B", f"{run['peak']:,} B") if run else ("–", "–")
        lines.append(f"{name:33} {ops['reduce_scatter'][0]:>15} {ops['all_gather'][0]:>11} {sent:>10,.0f} "
                     f"{sent / one:>8.1f} {held:>18} {peak:>10}")
    lines.append("– not measured: the per-micro-batch runs count only their collectives. By the formula they hold between steps")
    lines.append("  what once per step holds; during the step a full gradient lives only from a backward to its reduce-scatter")
    lines.append("* Llama 3's FSDP: counted from the ZeRO-3 per-micro-batch row (the forward's gathers only), not run")
    rs = {z: per_mb[z]["by_op"]["reduce_scatter"][1] for z in (1, 2)}
    return Report("\n".join(lines), _check_zero_table, per_mb=per_mb, rs=rs, m=m, once=once,
                  rs1=rs[1], llama3=llama3["bytes"])


def _sent_per_layout(recipe, layouts: dict) -> dict:
    """{layout: {"tp", "pp", "dp": the most bytes any rank sent per step}}, from the communication log; every
    rank's log checked against :func:`bytes_formula` for its stage."""
    cfg, (batch, seq) = recipe.model().cfg, recipe.batches[0][0].shape
    sent = {}
    for name, runs in layouts.items():
        lay = measure.LAYOUTS[name]
        for r in runs:
            f = bytes_formula(cfg, batch=batch, seq=seq, m=4, pp_rank=r.coords["pp"], **lay)
            claims.check_layout_bytes_equal_formula(name, r.bytes_by_kind, f)
        sent[name] = {k: max(r.bytes_by_kind[k] for r in runs) for k in ("tp", "pp", "dp")}
    return sent


def show_memory(recipe, runs_2x2x2: list, more: dict, psi: float = 1e9) -> dict:
    """§4: first one line of the model-state formula for a ``psi``-parameter model in mixed-precision Adam in
    four layouts; then the same layouts on 8 ranks (§3's run is the 2×2×2 row; ``more``: the other three from
    :func:`.measure.layout_runs`, one launch), per rank:
    peak and model states measured (ranked as the formula ranks them, checked), and the bytes each kind sent per
    step (communication log = formula, checked; max over the ranks); a bar chart; the claims on both. Returns
    {layout: (peak, model states)}."""
    import matplotlib.pyplot as plt
    layouts = {"2x2x2": runs_2x2x2, **{name: more[name][0] for name in ("4x2x1", "1x2x4", "2x2x2+zero1")}}
    memory = {name: (max(r.peak_bytes for r in rs), max(r.model_state_bytes for r in rs)) for name, rs in layouts.items()}
    sent = _sent_per_layout(recipe, layouts)
    formula = {name: measure.layout_memory_formula(psi, dp=lay["dp"], pp=lay["pp"], tp=lay["tp"], zero=lay.get("zero", 0))
               for name, lay in ((name, measure.LAYOUTS[name]) for name in memory)}
    big = f"{psi / 1e9:.0f}B model"
    fall = {"measured": 1 - memory["2x2x2+zero1"][1] / memory["2x2x2"][1],
            "formula": 1 - formula["2x2x2+zero1"] / formula["2x2x2"]}
    drop = [(memory["2x2x2"][i] - memory["2x2x2+zero1"][i]) / 1024 for i in (0, 1)]
    print(f"formula, {big} (mixed-precision Adam, 2 + 2 + 12 B per parameter): model states per rank, GB\n"
          + ", ".join(f"{name}: {formula[name] / 1e9:g}" for name in memory)
          + f"\nZeRO-1 on 2x2x2 cuts them by {fall['formula']:.1%}.")
    print(f"\nmeasured on the toy, model states in the same order (float64; per rank, the most of any rank; KiB)\n"
          f"{'layout dp×pp×tp':>16} {'peak':>7} {'model states':>13}")
    for name, (peak, states) in memory.items():
        print(f"{name:>16} {peak / 1024:>7.0f} {states / 1024:>13.0f}")
    print(f"ZeRO-1 on 2x2x2 cuts the toy's model states by {fall['measured']:.0%} ({drop[1]:.0f} KiB; "
          f"the peak falls {drop[0]:.0f} KiB*)")
    print(f"\nbytes sent per step (per rank, the most of any rank; KiB)\n{'layout dp×pp×tp':>16} {'TP':>5} {'PP':>5} {'DP':>5}")
    for name, b in sent.items():
        print(f"{name:>16} {b['tp'] / 1024:>5.0f} {b['pp'] / 1024:>5.0f} {b['dp'] / 1024:>5.0f}")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    figures.draw_memory(ax, memory)
    plt.show()
    claims.check_memory_per_layout(memory)
    claims.check_bytes_per_layout(sent)
    claims.check_zero1_peak_drop(memory)
    claims.check_layouts_compared(psi)
    claims.check_zero1_states_fall(fall)
    claims.check_same_order(memory, formula)
    return memory


def kinds_at_scale(h: int = 25600, n_layer: int = 128, seq: int = 2048, batch: int = 3072,
                   t: int = 8, p: int = 64, d: int = 6, value_bytes: int = 2, grad_bytes: int = 2, vocab: int = 51200,
                   tflops_per_gpu: float = 163.0) -> Report:
    """TP's, PP's and DP's values per rank per step for a middle stage of the 1T layout of Narayanan et al.
    2021, Table 1 (defaults), by §3's formulas: TP 2(t−1)/t · 6(L/p) · (B/d)·s·h (six all-reduces per block
    and micro-batch: §3's four, plus the forward's two again, since that run recomputes every block's forward
    in its backward, as its FLOP count below assumes; the whole batch of this replica); PP 2·(B/d)·s·h per stage boundary (activations forward, gradients back),
    whole or 1/t each with Megatron's scatter/gather; DP 2(d−1)/d · 12h²·(L/p)/t (a ring all-reduce of this
    rank's share of its stage). Beside them, in ``value_bytes`` (16-bit: the run is FP16; DP in ``grad_bytes``, 16-bit too:
    Megatron-LM reduces in FP32 by default only for BF16, chapter 10 §8; pass 4 for that case), seconds = bytes ÷ link bandwidth on
    the DGX A100's NVLink 3 and on one InfiniBand HDR port per GPU (a lower bound: no latency, full
    bandwidth). Under them, one step's length for scale: the paper's FLOPs per step (Eq. 3,
    96·B·s·L·h²·(1 + s/6h + V/16Lh), recomputation included) over its t·p·d GPUs at the ``tflops_per_gpu`` it
    measured (Table 1: 163 TFLOP/s per GPU)."""
    from minipar.machine.cluster import IB_HDR, NVLINK3
    activation = (batch // d) * seq * h
    all_reduces_per_block = 4 + 2                 # forward 2, backward 2, and the recomputed forward's 2
    tp_values = 2 * (t - 1) / t * all_reduces_per_block * (n_layer // p) * activation
    pp_values = 2 * activation
    dp_values = 2 * (d - 1) / d * 12 * h**2 * (n_layer // p) / t
    rows = [("TP, 6 all-reduces a block", tp_values, value_bytes), ("PP, whole from each TP rank", pp_values, value_bytes),
            ("PP, 1/t (scatter/gather)", pp_values / t, value_bytes), ("DP, ring all-reduce", dp_values, grad_bytes)]
    nv, ib = NVLINK3.bandwidth / 1e9, IB_HDR.bandwidth / 1e9
    lines = [f"1T layout (t {t}, p {p}, d {d}), a middle stage, per rank per step, {value_bytes} B a value"
             + (f", DP {grad_bytes} B a gradient" if grad_bytes != value_bytes else ""),
             f"{'':28} {'GB sent':>8} {f's, NVLink {nv:.0f} GB/s':>19} {f's, IB {ib:.0f} GB/s':>14}"]
    for name, values, nbytes in rows:
        gb = values * nbytes / 1e9
        lines.append(f"{name:28} {gb:>8.1f} {gb / nv:>19.2f} {gb / ib:>14.2f}")
    step_flops = 96 * batch * seq * n_layer * h**2 * (1 + seq / (6 * h) + vocab / (16 * n_layer * h))
    step_seconds = step_flops / (t * p * d * tflops_per_gpu * 1e12)
    seconds = {"TP on NVLink": tp_values * value_bytes / 1e9 / nv, "TP on IB": tp_values * value_bytes / 1e9 / ib,
               "PP at 1/t on IB": pp_values / t * value_bytes / 1e9 / ib, "DP on IB": dp_values * grad_bytes / 1e9 / ib}
    lines.append(f"one step of that run: {step_flops / 1e18:.1f} EFLOP ÷ ({t * p * d:,} GPUs × "
                 f"{tflops_per_gpu:.0f} TFLOP/s each, the paper's Table 1) = {step_seconds:.0f} s;\n  of it: "
                 + ", ".join(f"{k} {v / step_seconds:.1%}" for k, v in seconds.items()))
    share = {k: v / step_seconds for k, v in seconds.items()}        # §4's verdict, read off these shares
    pp, dp, tp_gain = share["PP at 1/t on IB"], share["DP on IB"], share["TP on IB"] - share["TP on NVLink"]
    lines.append(f"verdict: TP {'needs' if tp_gain > pp + dp else 'does not need'} NVLink ({share['TP on IB']:.1%} of the "
                 f"step on IB, {share['TP on NVLink']:.1%} on NVLink);\n  PP at 1/t ({pp:.1%}) and DP ({dp:.1%}) on IB: "
                 + ("both under 1%, so which of them is outermost barely changes the step" if max(pp, dp) < 0.01
                    else f"{'PP' if pp > dp else 'DP'} gains more from the faster links"))
    ours = {"tp": tp_values * value_bytes, "pp": pp_values * value_bytes, "dp": dp_values * grad_bytes,
            "step": step_seconds, "tp_nvlink": seconds["TP on NVLink"]}

    def check(r):
        claims.check_kinds_at_scale(tp_values, pp_values, dp_values, t, seconds, step_seconds, value_bytes, grad_bytes)
        claims.check_1t_agrees_with_chapter_12(ours, p)
    return Report("\n".join(lines), check)


def show_refusals(recipe) -> None:
    """§1: each of ``measure.BAD_LAYOUTS``, refused by ``validate`` before any process starts: its reason."""
    for bad in measure.BAD_LAYOUTS:
        try:
            validate(recipe, **bad)
        except ValueError as exc:
            print(f"{layout_name(bad)}: {str(exc).split(': ')[0]}")   # the reason's first clause


def qkv_bias_gradient(grad) -> Report:
    """Deeper: the largest |gradient| of the Q, K and V parts of one block's fused QKV bias (``grad``, one
    device); the K part is zero (softmax ignores a constant added to a whole row of scores)."""
    q, k, v = grad.chunk(3)
    text = (f"block 0, largest |gradient| of the QKV bias: Q {q.abs().max():.1e}, K {k.abs().max():.1e}, "
            f"V {v.abs().max():.1e}")
    return Report(text, lambda r: claims.check_k_bias_gradient_is_zero(k, q))


def show_checkpoint(files: list, out: list) -> None:
    """§6: the saved checkpoint's files, and every parameter loaded at the new layout equal to what was saved."""
    print(files)
    saved = {name: tensor for before, _, _ in out for name, tensor in before.items()}
    print("loaded at 1×2×4: every parameter equal, element for element, to what 2×2×2 saved")
    claims.check_checkpoint_that_changes_layout(saved, out)

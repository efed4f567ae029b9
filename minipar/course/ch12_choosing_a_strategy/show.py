"""What chapter 12's cells show: each function takes the numbers a cell computed, checks what the chapter's text
says about them (raising ``AssertionError`` when a sentence no longer holds) and returns a small table as
:class:`Shown` text, so that a cell is one call."""
from __future__ import annotations

import re

from minipar.machine.device import CARDS, FITTED
from minipar.plan import (GPT3_175B, Layout, activation_bytes_per_layer, estimate, family, hfu, mfu,
                          model_state_bytes_formula, parameters)
from minipar.plan.model import model_flops
from minipar.plan.published import RUNS, TOLERANCE, summary

__all__ = ["Shown", "layout_words", "estimate_words", "published", "checks_by_fitted_source", "mt_nlg_against_korthikanti", "llama3_derived", "hand_layouts", "plan_table", "one_knob", "table5_mfu", "one_device",
           "card_views"]

GB = 1e9


class Shown(str):
    """Text a notebook shows as it is: a cell ending in a call that returns it prints it, without quotes."""

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def layout_words(lay) -> str:
    """A layout in the chapter's words: the degrees first, then ZeRO, SP, recomputation and the micro-batches."""
    parts = [f"TP {lay.tp}", f"PP {lay.pp}" + (f" (v {lay.v})" if lay.v > 1 else ""), f"DP {lay.dp}"]
    parts += [f"CP {lay.cp}"] if lay.cp > 1 else []
    rest = ([f"ZeRO-{lay.zero}"] if lay.zero else []) + (["SP"] if lay.sp else []) \
        + ([f"{lay.recompute} recomputation"] if lay.recompute != "none" else []) \
        + [f"{lay.micro_batches} micro-batches of {lay.micro_batch}"] + ([lay.schedule] if lay.pp > 1 else [])
    return " · ".join(parts) + ", " + ", ".join(rest)


def estimate_words(e) -> str:
    """An estimate's memory per GPU, step and MFU, in words (``print(e)`` gives every term)."""
    fits = "" if e.fits else " (does not fit)"
    return f"{e.memory['total'] / GB:.1f} GB per GPU{fits}, {e.step_seconds:.1f} s per step, MFU {e.mfu:.1%}"


def published(pub: list, tolerance: float = TOLERANCE, full: bool = False) -> Shown:
    """Section 2: :func:`minipar.plan.published.table` as text, calibration rows first (sources in
    :mod:`minipar.plan.published`), a line counting the check rows within ±``tolerance``, and each card's one
    efficiency: fitted to which row, or measured (the provenance in full: :data:`minipar.machine.device.FITTED`).
    Unless ``full``, one row per source: its runs, the row fitted to, and the range of model ÷ published."""
    if full:
        lines = [f"{'run':26}{'GPUs':>22}{'published s':>13}{'model s':>9}{'ratio':>7}{'role':>13}"]
        lines += [f"{r['run']:26}{r['device']:>22}{r['published']:>13.2f}{r['predicted']:>9.2f}{r['ratio']:>7.2f}"
                  f"{r['role']:>13}" for r in sorted(pub, key=lambda r: r["role"] != "calibration")]
    else:
        lines = [f"{'source of the published runs':40}{'rows':>5}  {'η_F fitted to':22}model / published"
                 f"  others within ±{tolerance:.0%}"]
        for source in dict.fromkeys(r["source"].split(",")[0] for r in pub):
            rows = [r for r in pub if r["source"].split(",")[0] == source]
            ratios = [r["ratio"] for r in rows]
            fitted = next((r["run"] for r in rows if r["role"] == "calibration"), "-")
            checks = [r for r in rows if r["role"] == "check"]
            inside = sum(abs(r["ratio"] - 1) <= tolerance for r in checks)
            lines.append(f"{source:40}{len(rows):>5}  {fitted:22}{min(ratios):.2f} to {max(ratios):.2f}"
                         f"{f'{inside} of {len(checks)}':>14}")
    got = summary(pub, tolerance)
    split = checks_by_fitted_source(pub, tolerance)
    lines.append(f"within ±{tolerance:.0%}: {split[False][0]} of {split[False][1]} rows from sources nothing was fitted "
                 f"to; {split[True][0]} of {split[True][1]} from the same source as a fit"
                 + (f"; outside: {', '.join(got['outside'])}" if got["outside"] else ""))
    for card, what in FITTED.items():
        fitted_to = [r["run"] for r in pub if r["role"] == "calibration" and r["device"].endswith(card)]
        how = f"fitted to {fitted_to[0]}" if fitted_to else "measured on one H100 (700 W), fitted to nothing"
        kind = "effective efficiency (fitted: absorbs what the operator model misses)" if fitted_to else \
            "matmul efficiency"
        lines.append(f"{card}: {kind} η_F = {CARDS[card].gemm_efficiency}, {how}")
        assert what.startswith("calibration") == bool(fitted_to), card
    return Shown("\n".join(lines))


def checks_by_fitted_source(pub: list, tolerance: float) -> dict:
    """{True: (inside, checks) for check rows whose source also gave a calibration row (weak checks: same
    paper, code and hardware as the fit), False: the same for sources fitted to nothing}."""
    fitted = {r["source"].split(",")[0] for r in pub if r["role"] == "calibration"}
    split = {}
    for same in (True, False):
        checks = [r for r in pub if r["role"] == "check" and (r["source"].split(",")[0] in fitted) == same]
        split[same] = (sum(abs(r["ratio"] - 1) <= tolerance for r in checks), len(checks))
    return split


def _tflops(run, count):
    """TFLOP/s per GPU of a :class:`~minipar.plan.published.PublishedRun`: "model" (MFU's count) or
    "hardware" (the recomputed FLOPs counted too: HFU's)."""
    batch = run.layout.dp * run.layout.micro_batch * run.layout.micro_batches
    devices, peak = run.nodes * 8, run.card.peak_flops
    share = (mfu(run.model, batch, run.seconds, devices, peak) if count == "model"
             else hfu(run.model, batch, run.seconds, devices, peak, run.layout.recompute))
    return share * peak / 1e12


def mt_nlg_against_korthikanti() -> Shown:
    """Section 2: MT-NLG's 280-node rate beside Korthikanti et al.'s 530B rows, each from its published
    seconds and the FLOP formula, MT-NLG's with the recomputation counted (as its paper counts it)."""
    runs = {r.name: r for r in RUNS}
    mt, full, sel = (runs[k] for k in ("MT-NLG 530B, 280 nodes", "530B full recompute", "530B SP + selective"))
    rates = {"mt": _tflops(mt, "hardware"), "full": _tflops(full, "hardware"), "sel": _tflops(sel, "model")}
    lines = [f"MT-NLG 530B, 280 nodes, {mt.seconds} s: {rates['mt']:.0f} TFLOP/s per GPU, recomputation counted",
             f"Korthikanti et al. 530B full recompute, {full.seconds} s: {rates['full']:.0f} TFLOP/s per GPU, "
             f"recomputation counted",
             f"  same count, MT-NLG / Korthikanti: {rates['mt'] / rates['full']:.2f}",
             f"(Korthikanti et al. 530B SP + selective, {sel.seconds} s: {rates['sel']:.0f} TFLOP/s per GPU of "
             f"model FLOPs, MFU {rates['sel'] * 1e12 / sel.card.peak_flops:.1%})"]
    assert round(rates["mt"]) == 126 and round(rates["full"], -1) == 180           # §2.4 prints 126
    assert 0.65 < rates["mt"] / rates["full"] < 0.75
    return Shown("\n".join(lines))


def llama3_derived(pub: list, tolerance: float = TOLERANCE) -> Shown:
    """§6: Llama 3's seconds are derived, not published: Dubey et al. give TFLOP/s per GPU, and the library
    divides its own FLOP count (the s² attention term counted whole) by it. Had Meta counted causal attention
    (half that term), each derived time would be shorter; the line says by how much and what the 128K row's
    ratio would become."""
    runs = {r.name: r for r in RUNS}
    rows = {r["run"]: r for r in pub if r["run"].startswith("Llama 3 ")}
    shorter = {}
    for name in rows:
        run = runs[name]
        m, lay = run.model, run.layout
        tokens = lay.dp * lay.micro_batch * lay.micro_batches * m.seq_len
        whole = 3 * m.layers * 4 * tokens * m.seq_len * m.hidden            # QKᵀ and ·V, forward + backward
        shorter[name] = (whole / 2) / model_flops(m, tokens // m.seq_len)
    long_row = max(rows, key=lambda k: runs[k].model.seq_len)
    causal_ratio = rows[long_row]["ratio"] / (1 - shorter[long_row])
    short_rows = [shorter[k] for k in rows if k != long_row]
    lo, hi = (f"{min(short_rows) * 100:.0f}", f"{max(short_rows) * 100:.0f}")
    line = (f"Llama 3's seconds are derived: the library's FLOPs ÷ (GPUs × the published TFLOP/s), the s² attention\n"
            f"  counted whole. Counted causally (half of it), the 8K rows' times would be {lo if lo == hi else lo + '–' + hi} % "
            f"shorter and the 128K row's\n  {shorter[long_row] * 100:.0f} %: its model ÷ published "
            f"{rows[long_row]['ratio']:.2f} → {causal_ratio:.2f}, "
            f"{'inside' if abs(causal_ratio - 1) <= tolerance else 'outside'} ±{tolerance * 100:.0f} %")
    assert abs(rows[long_row]["ratio"] - 1) <= tolerance < abs(causal_ratio - 1)    # §6: the row hangs on the count
    assert all(abs(r["ratio"] / (1 - shorter[k]) - 1) <= tolerance for k, r in rows.items() if k != long_row)
    return Shown(line)


HAND_LAYOUTS = {"TP 8 · PP 16 · DP 8, 1F1B": Layout(dp=8, tp=8, pp=16, micro_batches=192),
                "ZeRO-3 · TP 2 · DP 512": Layout(dp=512, tp=2, zero=3, recompute="full", micro_batch=1,
                                                 micro_batches=3)}
_RECOMPUTED = {"none": "recomputes nothing: 6 FLOPs per parameter per token",
               "selective": "recomputes the attention core (selective): 6 FLOPs per parameter per token and a little",
               "full": "recomputes every layer (full): 8 FLOPs per parameter per token"}


def hand_layouts(best, cluster, tolerance: float = TOLERANCE) -> tuple:
    """Section 3: (the planner's pick beside :data:`HAND_LAYOUTS` as {label: Estimate}, their table, GPT-3's
    300 B tokens in days at the best's step time beside Narayanan et al.'s 8TP/(nX) (their Eq. 4, X = 140
    TFLOP/s per GPU), with the range §9's ±``tolerance`` on the check rows gives — as text)."""
    ests = {"planner's pick": best, **{k: estimate(GPT3_175B, cluster, l) for k, l in HAND_LAYOUTS.items()}}
    lines = [f"{k:<28}{e.memory['total'] / GB:6.1f} GB per GPU {e.step_seconds:6.2f} s per step  MFU {e.mfu:.1%}"
             for k, e in ests.items()]
    days = 300e9 / (1536 * 2048) * best.step_seconds / 86400
    low, high = days / (1 + tolerance), days / (1 - tolerance)      # published = model ÷ (model / published)
    narayanan = 8 * 300e9 * parameters(GPT3_175B) / (1024 * 140e12) / 86400
    lines += [f"GPT-3's 300 B tokens at {best.step_seconds:.1f} s per 1536 × 2048 tokens: {days:.0f} days "
              f"({low:.0f}–{high:.0f} at chapter 12 §6's ±{tolerance:.0%})",
              f"Narayanan et al.'s estimate 8TP/(nX): {narayanan:.0f} days",
              f"the planner's layout {_RECOMPUTED[best.layout.recompute]}"]
    assert best.step_seconds <= min(e.step_seconds for e in ests.values() if e.fits) + 1e-9
    assert 15 < days < 40 and round(narayanan) == 34 and low < days < high < narayanan
    return ests, Shown("\n".join(lines))


# The families the lesson needs (section 4): the pick's twin without ZeRO-1, TP across nodes, a pipeline
# without TP, and ZeRO-3 + TP (section 5's rival); the pick always comes first.
SHOWN_FAMILIES = ("DP + TP + PP", "ZeRO-1 + TP + PP (TP across nodes)", "ZeRO-1 + PP", "ZeRO-3 + TP")


def tp_changed(lay, tp: int, global_batch: int = 1536):
    """The layout at TP ``tp`` with DP changed to keep the devices, and the same global batch (TP 8 vs TP 4)."""
    from dataclasses import replace
    dp = lay.dp * lay.tp // tp
    return replace(lay, tp=tp, dp=dp, micro_batches=global_batch // (dp * lay.micro_batch))


def plan_rows(p) -> dict:
    """{family: the layout its row shows}: like with like, every family by the pick's rule (``Plan.picks``),
    the pick for its own; the smallest layout of a family that does not fit."""
    return {**p.families, **p.picks, family(p.best[0].layout): p.best[0]}


def with_zero1(p, cluster):
    """((DP + TP + PP's row, the same layout with ZeRO-1), one line of their steps and bytes): rule 1's "ZeRO-1
    costs no extra time" at equal degrees."""
    from dataclasses import replace
    dp = plan_rows(p)["DP + TP + PP"]
    twin = estimate(GPT3_175B, cluster, replace(dp.layout, zero=1))
    return (dp, twin), Shown(f"DP + TP + PP's row with ZeRO-1 added: {dp.step_seconds:.1f} -> {twin.step_seconds:.1f}"
                             f" s, {dp.memory['total'] / GB:.1f} -> {twin.memory['total'] / GB:.1f} GB per GPU")


def plan_table(p, full: bool = False) -> Shown:
    """Section 4: the planner's :class:`~minipar.plan.planner.Plan` as one row per family (its layout by the
    pick's rule, ``Plan.picks``) — fits?, memory,
    step, against the pick, and what it lost on (the term that cost it most, or memory). Unless ``full``,
    only the pick and :data:`SHOWN_FAMILIES` get a row, and one line names the families that do not fit;
    ``full`` also counts the layouts costed. ``print(p)`` prints every family's layout."""
    best = p.best[0]
    lines = [f"{p.considered} layouts costed, {p.feasible} fit, {len(p.families)} families"] if full else []
    lines += [f"{'family':40}{'fits':>5}{'GB per GPU':>11}{'s/step':>8}{'÷ pick':>8}  why it lost"]
    families = plan_rows(p)
    order = sorted(families.items(), key=lambda kv: (kv[1] is not best, not kv[1].fits, kv[1].step_seconds))
    if not full:
        misfits = [fam for fam, e in order if not e.fits]
        order = [(fam, e) for fam, e in order if fam not in p.rejected or fam in SHOWN_FAMILIES]
    for fam, e in order:
        why = p.rejected.get(fam, "the pick")
        if why.startswith("does not fit"):
            why = "does not fit"
        elif why.startswith("as fast"):
            why = f"inside the {p.tie * 100:.0f} % band, more memory"
        elif why != "the pick":
            why = re.sub(r" \(dp=.*\)$", "", why.split("): ", 1)[1])
        elif best.layout.pp > 1:     # the schedule is a tie (chapter 12 §4): the row shows the one memory chose
            why = f"the pick, priced with {best.layout.schedule.upper()}"
        step = f"{e.step_seconds:8.1f}{e.step_seconds / best.step_seconds:8.2f}" if e.fits else f"{'-':>8}{'-':>8}"
        lines.append(f"{_degree(fam, e):40}{'yes' if e.fits else 'no':>5}{e.memory['total'] / GB:11.1f}{step}  {why}")
    if not full:
        hidden = [(fam, e) for fam, e in sorted(families.items(), key=lambda kv: kv[1].step_seconds)
                  if e.fits and fam not in dict(order)]
        lines.append("also fit, ÷ pick:")
        items = [f"{_degree(fam, e)} {e.step_seconds / best.step_seconds:.2f}" for fam, e in hidden]
        lines += ["  " + ", ".join(items[i:i + 3]) for i in range(0, len(items), 3)]
        lines.append(f"these do not fit: {', '.join(_degree(fam, families[fam]) for fam in misfits)}")
    return Shown("\n".join(lines))


def _degree(family: str, e) -> str:
    """A family's name with the TP degree of its layout where the name says only that TP crosses nodes."""
    return family.replace("(TP across nodes)", f"(TP {e.layout.tp}, across nodes)")


def one_device(cluster) -> Shown:
    """Section 4: what the rules' "fits one device?" adds up: section 1's model states and one micro-batch's
    activations of every layer, without recomputation."""
    mem = estimate(GPT3_175B, cluster, Layout()).memory
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    assert abs(states - model_state_bytes_formula(parameters(GPT3_175B), 1, 0)["total"]) < 1e-6 * states
    assert abs(states + mem["activations"] + mem["buffers"] - mem["total"]) < 1e-6 * mem["total"]
    layers = GPT3_175B.layers * activation_bytes_per_layer(GPT3_175B, 1)
    return Shown(f"one device: model states {states / GB:.0f} GB + activations of one micro-batch, no recomputation, "
                 f"{mem['activations'] / GB:.0f} GB (96 layers {layers / GB:.1f} GB, the rest the output layer"
                 f"'s logits) = {mem['total'] / GB:.1f} GB")


def card_views(views: dict) -> Shown:
    """Section 6: the calculator's first view on the A100 and the H100 card, term by term, and how much
    faster each term runs on the H100 than its peak alone would say."""
    (a_name, a), (h_name, h) = views.items()
    lines = [f"{'seconds per step':26}{'GB per GPU':>11}{'MFU':>7}{'step':>8}{'compute':>9}{'TP':>7}{'other terms':>13}"]
    for name, e in views.items():
        rest = e.step_seconds - e.time["compute"] - e.time["tp"]
        lines.append(f"{name:26}{e.memory['total'] / GB:11.1f}{e.mfu:7.1%}{e.step_seconds:8.2f}"
                     f"{e.time['compute']:9.2f}{e.time['tp']:7.2f}{rest:13.2f}")
    peak = h.mfu * h.step_seconds / (a.mfu * a.step_seconds)     # MFU·time ∝ FLOPs / peak: the peaks' ratio inverted
    speed = {k: a.time[k] / h.time[k] for k in ("compute", "tp")}
    lines.append(f"H100 over A100: peak {1 / peak:.1f}x, compute {speed['compute']:.1f}x, TP all-reduces "
                 f"{speed['tp']:.1f}x, whole step {a.step_seconds / h.step_seconds:.1f}x")
    assert h.mfu < a.mfu and speed["tp"] < speed["compute"] < 1 / peak
    return Shown("\n".join(lines))


def one_knob(best, cluster, global_batch: int = 1536) -> Shown:
    """Section 4: the pick with each knob changed alone (TP halved with DP doubled, the schedule switched
    between 1F1B and interleaved, no SP, full recomputation, ZeRO-2 or -3: every micro-batch ZeRO-2 reduce-scatters
    its gradients, ZeRO-3 also re-gathers its parameters), each
    row's memory, step time against the pick (+ slower, − faster) and the two time terms that moved most."""
    from dataclasses import replace
    lay = best.layout
    other = tp_changed(lay, lay.tp // 2, global_batch)
    sched = replace(lay, v=1, schedule="1f1b") if lay.v > 1 else replace(lay, v=2, schedule="interleaved")
    knobs = {f"TP {other.tp} (DP {other.dp})": other,
             ("v = 1 (1F1B)" if lay.v > 1 else "v = 2 (interleaved)"): sched,
             "no SP": replace(lay, sp=False), "full recompute": replace(lay, recompute="full"),
             "ZeRO-2": replace(lay, zero=2), "ZeRO-3": replace(lay, zero=3)}     # their dp traffic per micro-batch
    lines = [f"{'one knob changed':20}{'GB per GPU':>11}{'s/step':>8}{'vs pick':>9}  "
             f"the two time terms that moved most (s: pick -> changed)",
             f"{'(none: the pick)':20}{best.memory['total'] / GB:11.1f}{best.step_seconds:8.2f}{'':9}"]
    for name, layout in knobs.items():
        e = estimate(GPT3_175B, cluster, layout)
        change = {k: v for k, v in e.time.items() if k != "total" and abs(v - best.time.get(k, 0.0)) > 0.05}
        top = sorted(change, key=lambda k: -abs(change[k] - best.time.get(k, 0.0)))[:2]
        moved = ", ".join(f"{k} {best.time.get(k, 0.0):.2f} -> {change[k]:.2f}" for k in top)
        fit = "" if e.fits else "  DOES NOT FIT"
        lines.append(f"{name:20}{e.memory['total'] / GB:11.1f}{e.step_seconds:8.2f}"
                     f"{e.step_seconds / best.step_seconds - 1:+9.1%}  {moved}{fit}")
    return Shown("\n".join(lines))


# Korthikanti et al. 2022, Table 3 (shapes) and Table 5 (selective recomputation + SP, iteration seconds, MFU %).
# The MFU values are confirmed by the NVIDIA/Megatron-LM README's table; the shapes and times are the ones
# tests/test_plan_model.py checks against them.
TABLE_5 = {"22B": (64, 6144, 48, 8, 4, 1.10, 41.5), "175B": (96, 12288, 96, 64, 64, 13.75, 51.4),
           "530B": (128, 20480, 105, 280, 280, 37.83, 56.0), "1T": (160, 25600, 128, 512, 512, 71.49, 56.3)}


def table5_mfu() -> Shown:
    """Section 2: the MFU formula on Korthikanti et al.'s four Table 5 runs, beside the MFU they print."""
    from minipar.plan import Transformer
    lines = [f"{'run':6}{'GPUs':>6}{'s/iter':>8}{'MFU here':>10}{'published':>11}"]
    for name, (heads, hidden, layers, gpus, batch, seconds, published_mfu) in TABLE_5.items():
        got = mfu(Transformer(layers, hidden, heads, 51200, 2048), batch, seconds, gpus, 312e12)
        lines.append(f"{name:6}{gpus:6}{seconds:8.2f}{got:10.1%}{published_mfu:10.1f}%")
        assert abs(100 * got - published_mfu) <= 100 * 0.005 / seconds * published_mfu / 100 + 0.06, name
    return Shown("\n".join(lines))

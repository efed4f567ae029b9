"""What chapter 12's cells show, one call per cell: each function prints a table (and draws where the section
has a picture), then holds the chapter's sentences about those numbers (:mod:`.claims`), printing nothing
more when they hold. The tables' text comes from :mod:`.show`, the pictures from :mod:`.figures`; chapter 12b's
cells are in :mod:`.toolbox`, re-exported here."""
from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt

from minipar import plan as mp
from minipar.machine.cluster import IB_HDR, NVLINK3, gpu_cluster
from minipar.machine.device import A100_SXM_80GB
from minipar.plan import (GPT3_175B, Transformer, a100_cluster, activation_bytes_per_layer, decide,
                          model_state_bytes_formula, parameters, plan)
from minipar.plan.published import TOLERANCE, rounded_up, spread_by_source, table as published_table

from minipar.course.plotting import show_with_alt

from . import claims, figures, overlap_table, show
from .toolbox import calculator_views, hand_layouts, oneflow_layout, sequence

__all__ = ["gpt3", "rules", "ACTIVATION_ROWS", "formulas", "in_flight_counts", "cost_model_sums", "planner", "pick_and_fastest", "band_by_source", "one_knob",
           "breakdown", "band_sweep", "efficiency_band", "hand_layouts", "rules_vs_planner", "small_case", "SMALL_GPT", "calculator_views", "sequence", "published", "mt_nlg", "card_row",
           "oneflow_layout", "FAST_INTER_NODE"]

GB = 1e9
# §5's fast links between nodes, a hypothetical: bytes/s per GPU as a large ring reaches them (a cluster's
# bandwidths are all effective: link card × efficiency), between InfiniBand's 22 and NVLink 3's 300 × 0.77 = 231
# inside a node, and above the rules' "fast" threshold (rules.FAST_LINK_RATIO × 231).
FAST_INTER_NODE = 150e9


def gpt3() -> None:
    """Setup: GPT-3 175B's shape and its parameters by Narayanan et al. 2021, Eq. 2."""
    m = GPT3_175B
    print(f"GPT-3 175B: {m.layers} layers, hidden size {m.hidden}, {m.heads} heads, vocabulary {m.vocab}, sequence "
          f"{m.seq_len}: {parameters(m) / 1e9:.1f} B parameters (Narayanan et al. 2021, Eq. 2)")
    claims.check_choosing_strategy_cost_model_planner()


def rules(advice, cluster) -> None:
    """§1: the rules' walk for this cluster, what "fast" means, what "fits one device?" adds up, and the flow chart."""
    print(advice)
    print(f"fast links between nodes: from {mp.rules.FAST_LINK_RATIO:g} × the bandwidth inside a node, "
          f"{mp.rules.FAST_LINK_RATIO * cluster.intra_bw / 1e9:.0f} GB/s per GPU (the course's choice: the guide names "
          f"no number)")
    print(show.one_device(cluster))
    fig, ax = plt.subplots(figsize=(12, 5.2))
    figures.draw_decision_guide(ax, highlight={"start", "many", "many_no", "many_no_layer", "many_no_layer_no"})
    show_with_alt(fig, "The decision guide as a tree of questions: how many devices, does the model fit one device, does "
               "its largest layer fit, are the links between nodes fast. The red path, this case, runs: many "
               "nodes; does not fit one device; its largest layer fits; slow links between nodes; ending at "
               "DP + PP + TP + ZeRO-1.")


ACTIVATION_ROWS = {"no parallelism": dict(), "TP 8": dict(tp=8), "TP 8 + SP": dict(tp=8, sp=True),
                   "TP 8 + SP + selective": dict(tp=8, sp=True, recompute="selective"),
                   "full recompute (no TP)": dict(recompute="full")}


def formulas() -> dict:
    """§2: one layer's activation bytes under each row of :data:`ACTIVATION_ROWS` (micro-batch 1), the model
    states on one device, and the MFU formula on Korthikanti et al.'s Table 5. Returns the activations."""
    acts = {k: activation_bytes_per_layer(GPT3_175B, 1, **kw) for k, kw in ACTIVATION_ROWS.items()}
    print("GPT-3, s = 2048, b = 1: activation bytes one layer keeps for the backward, per device")
    for k, v in acts.items():
        print(f"  {k:<24}{v / GB:8.3f} GB   × 96 layers = {96 * v / GB:7.1f} GB")
    states = model_state_bytes_formula(parameters(GPT3_175B), 1, 0)["total"]
    print(f"model states on one device: {states / GB:.0f} GB (16 bytes × Ψ)")
    print(show.table5_mfu())
    claims.check_what_one_model_costs_four(acts, GB)
    return acts


def in_flight_counts(p: int = 4, m: int = 8) -> None:
    """§3: micro-batches in flight on the busiest stage for each schedule, p stages, m micro-batches."""
    counts = {s: mp.in_flight(s, p, m, 2 if s == "interleaved" else 1) for s in ("gpipe", "1f1b", "interleaved")}
    print(f"micro-batches in flight on the busiest stage, p = {p}, m = {m}: GPipe {counts['gpipe']:g}, "
          f"1F1B {counts['1f1b']:g}, interleaved (v = 2) {counts['interleaved']:g}")
    claims.check_cost_model_memory_time_one()


SMALL_GPT = Transformer(24, 2048, 16, 51200, 2048)      # GPT 1.3B (the calculator's), before GPT-3


def small_case(batch: int = 512) -> None:
    """§4's stepping stone: the rules and the planner for GPT 1.3B on one DGX A100 node of 8: it fits one GPU,
    so both name data parallelism."""
    cluster = a100_cluster(1)
    advice, p = decide(SMALL_GPT, cluster), plan(SMALL_GPT, cluster, batch, top=1)
    pick, rows = p.best[0], show.plan_rows(p)
    print(f"GPT 1.3B on one node of 8 A100s, batch {batch}: the rules' walk")
    print(advice)
    f = p.fastest
    print(f"\nfastest layout of all: {mp.family(f.layout)}, {f.layout.micro_batches} micro-batches of "
          f"{f.layout.micro_batch}: {f.step_seconds:.2f} s, {f.memory['total'] / GB:.1f} GB per GPU; the band: up to "
          f"{1 + p.tie:.2f} × {f.step_seconds:.2f} = {(1 + p.tie) * f.step_seconds:.2f} s")
    print("the families the rules named, each by the pick rule:")
    print(f"  {'family':8}{'GB per GPU':>11}{'s/step':>8}{'dp s':>7}  micro-batches")
    for fam in advice.families:
        e = rows[fam]
        print(f"  {fam:8}{e.memory['total'] / GB:11.1f}{e.step_seconds:8.2f}{e.time['dp']:7.2f}  "
              f"{e.layout.micro_batches} of {e.layout.micro_batch}" + ("   the pick" if e is pick else ""))
    m = pick.layout.micro_batches
    lean = {z: mp.estimate(SMALL_GPT, cluster, replace(pick.layout, zero=z)) for z in (2, 3)}
    print(f"at {m} micro-batches of {pick.layout.micro_batch}, ZeRO-2 and -3 would hold "
          + " and ".join(f"{e.memory['total'] / GB:.1f}" for e in lean.values()) + " GB but take "
          + " and ".join(f"{e.step_seconds:.2f}" for e in lean.values()) + " s (dp "
          + " and ".join(f"{e.time['dp']:.2f}" for e in lean.values()) + " s): outside the band")
    claims.check_small_case(advice, pick, rows, lean, p)


def planner(p, advice, cluster, full: bool = False) -> None:
    """§4: the planner's answer, one row per family (the lesson's few unless ``full``), the layouts that also fit
    or do not, and DP + TP + PP's row with ZeRO-1 added. The pick against the fastest is :func:`pick_and_fastest`."""
    print(show.plan_table(p, full))
    (dp, twin), line = show.with_zero1(p, cluster)
    print(line)
    claims.check_family_rows_by_one_rule(p, show.plan_rows(p), dp, twin)
    claims.check_published_decision_guide_as_rules(advice, p.best[0])


def pick_and_fastest(p, cluster) -> None:
    """§4: the fastest layout, the band it sets, and the pick's degrees under both schedules: 1F1B (the planner's
    ``best[0]``, by memory) and interleaved, a few % apart, both inside the band: the schedule is a tie."""
    pick, fastest = p.best[0], p.fastest
    lay = pick.layout
    other = mp.estimate(GPT3_175B, cluster, replace(lay, v=2, schedule="interleaved") if lay.v == 1
                        else replace(lay, v=1, schedule="1f1b"))
    band = (1 + p.tie) * fastest.step_seconds
    print(f"fastest: {show.layout_words(fastest.layout)}: {show.estimate_words(fastest)}")
    print(f"the band: up to {1 + p.tie:.2f} × {fastest.step_seconds:.2f} = {band:.2f} s; inside it, memory decides")
    print(f"\nTP {lay.tp} · PP {lay.pp} · DP {lay.dp}, ZeRO-{lay.zero}, {'SP, ' if lay.sp else ''}{lay.recompute} "
          f"recomputation, {lay.micro_batches} micro-batches of {lay.micro_batch}, under each schedule:")
    print(f"  {'schedule':20}{'GB per GPU':>11}{'s/step':>8}{'vs fastest':>12}")
    for e in sorted((pick, other), key=lambda e: e.layout.v):
        name = "1F1B" if e.layout.v == 1 else f"interleaved (v {e.layout.v})"
        print(f"  {name:20}{e.memory['total'] / GB:11.1f}{e.step_seconds:8.2f}"
              f"{(e.step_seconds / fastest.step_seconds - 1) * 100:+11.2f}%")
    gap = abs(1 - other.step_seconds / pick.step_seconds)
    print(f"\nthe pick: TP {lay.tp} × PP {lay.pp}, ZeRO-{lay.zero}, {'SP, ' if lay.sp else ''}{lay.recompute} "
          f"recomputation. Its schedule is a tie (1F1B and interleaved {gap * 100:.1f} % apart, inside the model's "
          f"{p.tie * 100:.0f} %): priced from here on with {lay.schedule.upper()}, the one with less memory "
          f"({pick.memory['total'] / GB:.1f} vs {other.memory['total'] / GB:.1f} GB)")
    claims.check_tie_band(p, other, gap)
    claims.check_planner_gpt_3_175b_1024(pick)


def band_by_source(p) -> None:
    """§6: where §4's band comes from: the model ÷ published step, highest ÷ lowest inside each source of
    published runs; the widest, rounded up to a multiple of 5 %, is ``p.tie``."""
    pub = published_table()
    spreads = spread_by_source(pub)
    fitted = {r["source"].split(",")[0] for r in pub if r["role"] == "calibration"}
    print(f"the {p.tie * 100:.0f} % band: model ÷ published step, highest ÷ lowest inside one source")
    for src, v in spreads.items():
        print(f"  {src.split(' (')[0]:32}{v:6.3f}  " + ("η_F fitted to one of its rows" if src in fitted
                                                       else "fitted to nothing"))
    print(f"  the widest, rounded up to a multiple of 5 %: {p.tie * 100:.0f} %; Llama 3's alone: "
          f"{rounded_up(spreads[LLAMA3] - 1) * 100:.0f} %")
    claims.check_band_from_sources(p, spreads, rounded_up(spreads[LLAMA3] - 1),
                                   [r["ratio"] for r in pub if r["source"].startswith("Korthikanti")])


def band_sweep(p, cluster) -> None:
    """§4: what the band's width decides. Every layout of ``p``'s search is priced once more; the planner's own
    pick rule (:func:`minipar.plan.planner.pick`) is applied at every band narrower than ``p.tie`` at which the
    pick changes, from ``p``'s pick down to the fastest (band 0). Costs one more pass over the search space."""
    fits = [e for lay in mp.planner.layouts(GPT3_175B, cluster, 1536)
            if (e := mp.estimate(GPT3_175B, cluster, lay)).fits]
    fastest = min(e.step_seconds for e in fits)
    inside = [e for e in fits if e.step_seconds <= (1 + p.tie) * fastest]
    rows = []                                     # (lowest band that gives it, its estimate), widest band first
    for t in sorted({e.step_seconds / fastest - 1 for e in inside}, reverse=True):
        e = mp.planner.pick(inside, fastest, t)
        if rows and rows[-1][1].layout == e.layout:
            rows[-1] = (t, e)
        else:
            rows.append((t, e))
    print(f"the pick as the band narrows from {p.tie * 100:.0f} % (the same rule on every layout that fits; "
          f"all ZeRO-1, SP, selective)")
    print(f"  {'band':>12}  {'pick':36}{'GB per GPU':>11}{'s/step':>8}")
    for i, (t, e) in enumerate(rows):
        top, lay = p.tie if i == 0 else rows[i - 1][0], e.layout
        words = overlap_table.short(replace(lay, zero=0)) + (", 1F1B" if lay.schedule == "1f1b" else ", interleaved") + (
            f", b {lay.micro_batch}" if lay.micro_batch > 1 else "")
        band = f"{t * 100:.2f}–{top * 100:.2f} %" if t > 0 else f"under {top * 100:.2f} %"
        print(f"  {band:>12}  {words:36}{e.memory['total'] / GB:11.1f}{e.step_seconds:8.2f}")
    measured = max(spread_by_source(published_table()).values()) - 1      # §6's band before rounding up
    at = mp.planner.pick(inside, fastest, measured)
    print(f"§6 measures the band as {measured * 100:.1f} % and rounds it up to {p.tie * 100:.0f} %; at "
          f"{measured * 100:.1f} % the rule takes {overlap_table.short(replace(at.layout, zero=0))}, "
          f"{at.layout.schedule} ({at.memory['total'] / GB:.1f} GB)")
    claims.check_band_sweep(p, rows, measured, at)


LLAMA3 = "Dubey et al. 2024 (Llama 3)"


def cost_model_sums():
    """§3: the two sums of :func:`minipar.plan.estimate`, the library's own source."""
    from minipar.course.report import show_source
    from minipar.plan import sums
    return show_source(sums.device_memory, sums.step_time, folded="The library's code of the two sums")


def breakdown(pick) -> None:
    """§4: the pick priced term by term: memory = model states + activations (one layer's, Korthikanti
    et al.'s Table 2, × layers per stage × micro-batches in flight) + buffers; time = compute + bubble + each
    collective + the optimizer; the bubble worked by hand, (compute + tp) × (p − 1)/(v·m)."""
    lay, mem, t = pick.layout, pick.memory, pick.time
    per_layer = activation_bytes_per_layer(GPT3_175B, lay.micro_batch, tp=lay.tp, sp=lay.sp, recompute=lay.recompute)
    layers = GPT3_175B.layers // lay.pp
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    print(f"memory {mem['total'] / GB:.1f} GB = model states {states / GB:.1f} + activations {mem['activations'] / GB:.1f}"
          f" ({per_layer / GB:.3f} GB per layer × {layers} layers × {pick.in_flight:g} in flight) + buffers "
          f"{mem['buffers'] / GB:.1f}")
    terms = [k for k in ("compute", "bubble", "tp", "cp", "pp", "dp", "optimizer") if t.get(k)]
    print(f"time {t['total']:.2f} s = " + " + ".join(f"{k} {t[k]:.2f}" for k in terms))
    print(f"bubble by hand: (compute + tp) × (p − 1)/(v·m) = ({t['compute']:.2f} + {t['tp']:.2f}) × "
          f"{lay.pp - 1}/({lay.v}·{lay.micro_batches}) = {(t['compute'] + t['tp']) * (lay.pp - 1) / (lay.v * lay.micro_batches):.2f} s")
    claims.check_breakdown_adds_up(pick, per_layer, layers)


def one_knob(pick, cluster) -> None:
    """§4: the pick, then each knob changed alone, and the time terms that moved."""
    print(show.one_knob(pick, cluster))
    no_sp = mp.estimate(GPT3_175B, cluster, replace(pick.layout, sp=False))
    megatron = no_sp.step_seconds - no_sp.time["pp"] + pick.time["pp"]     # the send at 1/t, as with SP
    print(f"no SP, its stage-to-stage send cut to 1/{pick.layout.tp} (Megatron's scatter/gather): pp "
          f"{no_sp.time['pp']:.2f} -> {pick.time['pp']:.2f} s, step {megatron:.2f} s, "
          f"{megatron / pick.step_seconds - 1:+.1%} against the pick")
    claims.check_one_knob_at_a_time(pick, cluster)
    claims.check_no_sp_row(pick, no_sp, megatron)


def efficiency_band(p, band: float = 0.15) -> None:
    """§4: the planner again with the A100's fitted matmul efficiency η_F 15 % lower and higher (§6's band),
    then with the links' assumed ring efficiencies (NVLink 77 %, InfiniBand 90 % of the datasheet) at 60 % and
    at 100 %, in one table: step, MFU, and whether the winner's layout is the same as at the fitted values.
    ``p`` is the plan at the fitted η_F and the assumed links."""
    card, pick0 = A100_SXM_80GB, p.best[0]
    lines = [f"{'planned with':36}{'step s':>7}{'MFU':>7}  same pick?"]

    def row(what, pl):
        pick = pl.best[0]
        same = pick.layout == pick0.layout
        degrees = same or replace(pick.layout, v=1, schedule="1f1b") == replace(pick0.layout, v=1, schedule="1f1b")
        lines.append(f"{what:36}{pick.step_seconds:7.1f}{pick.mfu:7.1%}  " + (
            "yes" if same else f"same degrees, {pick.layout.schedule} (v {pick.layout.v})" if degrees
            else show.layout_words(pick.layout)))
        return pick

    bests = {}
    for f in (1 - band, 1.0, 1 + band):
        eta = card.gemm_efficiency * f
        pl = p if f == 1.0 else plan(GPT3_175B, gpu_cluster(replace(card, gemm_efficiency=eta), 128, NVLINK3, IB_HDR),
                                     1536, top=1)
        bests[f] = row(f"η_F {eta:.2f}" + (" (fitted), links as assumed" if f == 1.0 else ""), pl)
    claims.check_efficiency_band(bests)
    by_link = {(NVLINK3.efficiency, IB_HDR.efficiency): pick0}
    for nvlink, ib in ((0.6, 0.6), (1.0, 1.0)):
        pl = plan(GPT3_175B, gpu_cluster(card, 128, replace(NVLINK3, efficiency=nvlink), replace(IB_HDR, efficiency=ib)),
                  1536, top=1)
        by_link[nvlink, ib] = row(f"links at {nvlink:.0%} of datasheet", pl)
    print("\n".join(lines))    # one table, printed once the plans are done
    claims.check_link_efficiency_band(by_link)


def rules_vs_planner(cluster, p) -> dict:
    """§5: the rules and the planner on section 4's cluster and on one with fast links between nodes, each
    with overlap off (every collective exposed) and on (what PyTorch DDP, DeepSpeed and FSDP hide:
    :mod:`minipar.plan.overlap`). Prints the rules' walk on the fast cluster and one row per case; returns
    the four plans by (links, overlap)."""
    fast = replace(cluster, inter_bw=FAST_INTER_NODE)
    slow_gbs, fast_gbs = f"{cluster.inter_bw / 1e9:.0f} GB/s", f"{fast.inter_bw / 1e9:.0f} GB/s"
    plans = {(slow_gbs, "off"): p}
    for links, c in ((slow_gbs, cluster), (fast_gbs, fast)):
        for overlap in ("off", "on"):
            if (links, overlap) not in plans:
                plans[links, overlap] = plan(GPT3_175B, c, 1536, top=1, overlap=overlap == "on")
    advice = {slow_gbs: decide(GPT3_175B, cluster), fast_gbs: decide(GPT3_175B, fast)}
    print(f"the rules' walk with {fast.inter_bw / 1e9:.0f} GB/s per GPU between nodes (fast from "
          f"{mp.rules.FAST_LINK_RATIO * fast.intra_bw / 1e9:.0f} GB/s, §1's threshold):")
    print(advice[fast_gbs])
    print("\n" + overlap_table.table(plans))
    in_node = p.pick_among(lambda fam: fam == "ZeRO-3 + TP")
    print(f"band: {1 + p.tie:.2f} × the fastest. §4's prediction, ZeRO-3 with TP inside a node, first row: "
          f"{in_node.step_seconds:.1f} s (TP {in_node.layout.tp}), {in_node.step_seconds / p.best[0].step_seconds:.2f} × "
          f"the pick")
    claims.check_zero3_across_nodes(overlap_table.sides(p)[1], in_node)
    claims.check_decision_guide_on_fast_network(fast, plans[fast_gbs, "off"])
    claims.check_overlap_decides(plans[slow_gbs, "off"], plans[slow_gbs, "on"], plans[fast_gbs, "off"],
                                 plans[fast_gbs, "on"])
    return plans


def published(pub, full: bool = False) -> float:
    """§6: the published runs drawn and tabled (one row per source unless ``full``); returns the share of the
    independent check rows (sources fitted to nothing) within ±15 % (a float that prints as "k of n")."""
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    figures.draw_published(pub, ax)
    show_with_alt(fig, "Model seconds per iteration against published seconds, one point per published run, on log "
               f"scales, with the line model = published and a grey band of ±{TOLERANCE * 100:.0f} %. MT-NLG's three runs lie below "
               "the band; every other run lies inside it.")
    print(show.published(pub, full=full))
    print(show.llama3_derived(pub))
    claims.check_one_calibration_per_card(pub)
    claims.check_misses_are_mt_nlg(pub, TOLERANCE)
    return Counted(*show.checks_by_fitted_source(pub, TOLERANCE)[False])


class Counted(float):
    """A share k/n that prints as "k of n": it is counted off a table, so 0.7857 would claim digits it lacks.
    It stays a float, so a guess of 0.8 is compared with k/n."""

    def __new__(cls, k: int, n: int):
        share = super().__new__(cls, k / n)
        share.k, share.n = k, n
        return share

    def __format__(self, spec: str) -> str:
        return f"{self.k} of {self.n}"


def mt_nlg() -> None:
    """§6: MT-NLG's rate beside Korthikanti et al.'s 530B rows, counted the same way."""
    print(show.mt_nlg_against_korthikanti())


def card_row(pub, run: str = "175B SP + selective") -> None:
    """§6: one published row term by term, and the A100 card it is priced on (each number's source: the card's
    ``source``, shown on the library page)."""
    row = next(r for r in pub if r["run"] == run)
    print(f"{row['run']} on {row['device']}: " + " + ".join(f"{k} {v:.2f}" for k, v in row["terms"].items())
          + f" = {row['predicted']:.2f} s per iteration (published {row['published']:.2f} s)")
    card = A100_SXM_80GB
    print(f"{card.name}: peak {card.peak_flops / 1e12:.0f} TFLOP/s × η_F {card.gemm_efficiency} (fitted), "
          f"HBM {card.hbm_bandwidth / 1e12:.2f} TB/s × η_B {card.memory_efficiency}, "
          f"launch floor {card.launch_floor * 1e6:.0f} µs")
    claims.check_time_gpu_device_model_checked(row)

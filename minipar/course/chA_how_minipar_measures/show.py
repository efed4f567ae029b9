"""What appendix A's cells show: each function takes the numbers a cell computed (or a recording of them,
:mod:`.recorded`), checks what the appendix's text says about them (raising ``AssertionError`` when a sentence
no longer holds) and returns a small table as :class:`Shown` text, so that a cell is one call."""
from __future__ import annotations

from minipar.plan import GPT3_175B

from . import calibration as cal12
from . import replay_bench
from . import time_model as tm12

__all__ = ["Shown", "tour_rows", "step_time_table", "links_table", "replay_table",
           "rankings_table", "a100_ddp", "gpt3_split"]

GB = 1e9


class Shown(str):
    """Text a notebook shows as it is: a cell ending in a call that returns it prints it, without quotes."""

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def tour_rows(rows: list) -> Shown:
    """§2: tour rows beside the cost model — bytes predicted, in the log, on the wire; activations
    measured and predicted. The log's bytes equal the prediction and the wire carries at least as many."""
    lines = []
    for r in rows:
        wire = "n/a" if r["bytes_observed"] is None else f"{r['bytes_observed']:.0f}"   # no /proc/self/io: unknown
        lines.append(f"{r['strategy']:<42} bytes: {r['bytes_predicted']:>8.0f} predicted, {r['bytes_measured']:>8.0f} "
                     f"in the log, {wire:>8} on the wire;  activations {r['memory_measured']:>6} B measured, "
                     f"{r['memory_predicted']:>6.0f} B predicted")
    assert all(r["matches"] and r["bytes_measured"] == r["bytes_predicted"] for r in rows)
    assert all(r["bytes_observed"] is None or r["bytes_observed"] >= r["bytes_measured"] for r in rows)
    return Shown("\n".join(lines))


def step_time_table(cal: dict, fid: dict, step_rows: list) -> Shown:
    """§2: per strategy the measured step (median [min–max] over the runs), predicted with compute
    counted and with the wire cut (* inside the measured range), the cut prediction's terms; the calibration's
    links; which strategies the cut predicts closer, and which stay more than 15 % above it in every run."""
    span = lambda s: f"{s['median'] * 1e3:4.0f} [{s['min'] * 1e3:.0f}–{s['max'] * 1e3:.0f}]"  # noqa: E731
    lines = [f"{cal['ranks']} ranks; alpha {cal['alpha'] * 1e6:.0f} us, beta {cal['beta'] / 1e9:.2f} GB/s; one thread "
             f"alone {cal['alone_flops'] / 1e9:.1f} GFLOP/s training (bare matmul {cal['matmul_flops'] / 1e9:.0f})",
             f"a step = the slowest rank's, median over the steps; median [min–max] over {fid['runs']} runs (ms); "
             f"* = the prediction lies inside the measured range",
             f"{'':9}{'measured':>17}{'counted':>9}{'cut':>9}   terms with the cut (ms)"]
    for r in step_rows:
        s = r["measured_spread"]
        mark = lambda p: "*" if s["min"] <= p <= s["max"] else " "  # noqa: E731
        terms = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r["terms_cut"].items() if v >= 5e-4)
        lines.append(f"{r['name']:<9}{span(s):>17}{r['predicted'] * 1e3:8.0f}{mark(r['predicted'])}"
                     f"{r['predicted_cut'] * 1e3:8.0f}{mark(r['predicted_cut'])}   {terms}")
    fitted = cal12.allreduce_link(cal, cal["ranks"])
    pingpong = f"ping-pong: alpha {cal['alpha'] * 1e6:.0f} us, beta {cal['beta'] / 1e9:.2f} GB/s"
    lines.append(f"gloo's all-reduce fitted: alpha {fitted[1] * 1e6:.0f} us per ring step, beta {fitted[0] / 1e9:.2f} "
                 f"GB/s ({pingpong})" if fitted else f"gloo's all-reduce: no α-β fit to its timings ({pingpong})")
    off = lambda measured, predicted: abs(measured / predicted - 1)  # noqa: E731
    closer = [r["name"] for r in step_rows if off(r["measured"], r["predicted_cut"]) < off(r["measured"], r["predicted"])]
    above = [r["name"] for r in step_rows if r["measured_spread"]["min"] > 1.15 * r["predicted_cut"]]
    lines.append(f"compute measured (the cut) predicts closer than compute counted for: {', '.join(closer) or 'none'}")
    lines.append(f"more than 15 % slower than predicted with compute measured, in every run: {', '.join(above) or 'none'}")
    assert len(step_rows) == 8 and all(r["measured"] > 0 and r["predicted"] > 0 and r["cut"] > 0 for r in step_rows)
    assert [r["measured"] for r in step_rows] == [row["measured"]["median"] for row in fid["rows"]]
    assert all(len(row["measured"]["runs"]) == fid["runs"] for row in fid["rows"])
    return Shown("\n".join(lines))


def links_table(cal: dict, links) -> Shown:
    """§3: each op's fitted α, β (:func:`.calibration.op_links`), the ping-pong's, and each timed call's
    median and mean."""
    if links is None:                # no op's time grew with its size: nothing to fit (a very busy machine)
        lines = ["no collective's time grew with its size: no link fitted; the replays use the cluster's link"]
    else:
        lines = [f"{op:15} alpha {hop * 1e6:6.0f} us per ring step, beta {bw / 1e9:6.3f} GB/s"
                 for op, (bw, hop) in links.ops.items()]
        lines.append(f"{'send/recv':15} alpha {links.p2p[1] * 1e6:6.0f} us, beta {links.p2p[0] / 1e9:6.3f} GB/s "
                     f"(ping-pong, mean)")
    lines += ["", f"one call, {cal12.COLLECTIVE_REPEATS} calls after a barrier on {cal['ranks']} ranks (us):",
              f"{'':15}{'bytes':>9}{'median':>9}{'mean':>9}"]
    lines += [f"{key:15}{size:9d}{cal[f'{key}_{size}_median_s'] * 1e6:9.0f}{cal[f'{key}_{size}_s'] * 1e6:9.0f}"
              for key in ("allreduce", "all_gather", "reduce_scatter") for size in cal12.ALLREDUCE_SIZES]
    assert links is None or set(links.ops) <= {"all_reduce", "all_gather", "reduce_scatter"}
    assert links is None or links.p2p == (cal["p2p_beta"], cal["p2p_alpha"])
    return Shown("\n".join(lines))


def replay_table(fid: dict) -> Shown:
    """§3: :func:`.replay_bench.format_table`, which strategies the replay puts within ±15 % of
    measured, the engine check, and each miss's sentence (its sign and term checked against the ratios)."""
    rows, tol, engine_tol = fid["rows"], replay_bench.TOLERANCE, replay_bench.ENGINE_TOLERANCE
    within = [r["name"] for r in rows if r["miss"] is None]
    engine = [r["name"] for r in rows if abs(r["ratio_replay_here_engine"]["median"] - 1) <= engine_tol]
    lines = [replay_bench.format_table(fid, agreements=False, rankings=False), "",
             f"replay here within ±{tol:.0%} of measured (median over the runs): {', '.join(within) or 'none'}",
             f"the engine check within ±{engine_tol:.0%}: {len(engine)} of {len(rows)}"
             + (f"; outside: {', '.join(r['name'] for r in rows if r['name'] not in engine)}" if len(engine) < len(rows) else "")]
    lines += [f"  {r['name']:8} {r['miss']}" for r in rows if r["miss"]]
    assert len(rows) == 8 and all(len(r["measured"]["runs"]) == fid["runs"] for r in rows)
    assert all(r["measured"]["min"] <= r["measured"]["median"] <= r["measured"]["max"] for r in rows)
    assert all((r["miss"] is None) == (abs(r["ratio_replay_here"]["median"] - 1) <= tol) for r in rows)
    assert all(r["miss"] is None or r["miss"].startswith("too short" if r["ratio_replay_here"]["median"] < 1 else "too long")
               for r in rows)
    return Shown("\n".join(lines))


def rankings_table(fid: dict) -> Shown:
    """§3: for each check of :data:`.replay_bench.AGREEMENTS`, the pairs apart, in order, swapped, tied
    and γ (:func:`.time_model.ranking_outside_spread`); the fastest set by the planner and by the replay, and
    where they share none, both sides' terms; how much shorter a step is replayed on the DGX-A100 node."""
    by_name = {r["name"]: r for r in fid["rows"]}
    column = lambda key: {r["name"]: r[key] for r in fid["rows"]}  # noqa: E731
    lines = []
    for label, (predicted, observed) in replay_bench.AGREEMENTS.items():
        g = tm12.ranking_outside_spread(column(predicted), column(observed))
        swapped = "; swapped: " + ", ".join(f"{a}/{b}" for a, b in g["swapped"]) if g["swapped"] else ""
        gamma = "no pair apart" if g["concordant"] + g["discordant"] == 0 else f"gamma {g['gamma']:+.2f}"
        lines.append(f"{label:37} {g['concordant'] + g['discordant']:2} of {g['pairs']} pairs apart: {g['concordant']} "
                     f"in order, {g['discordant']} swapped, {len(g['tied'])} tied; {gamma}{swapped}")
        assert g["concordant"] + g["discordant"] + len(g["tied"]) == g["pairs"] == 28
    lines.append("")
    for label, where, replayed, (unit, unit_name) in (
            ("planner vs replay, here", "here", "replay_here_one_link", (1e-3, "ms")),
            ("planner vs replay, DGX-A100", "dgx_a100", "replay_dgx_a100", (1e-6, "us"))):
        predicted, observed = replay_bench.AGREEMENTS[label]
        first_p, first_o = tm12.tied_first(column(predicted)), tm12.tied_first(column(observed))
        shared = [n for n in first_p if n in first_o]
        lines.append(f"{label}: fastest by the planner {', '.join(first_p)}; by the replay {', '.join(first_o)}"
                     + (f" — they share {', '.join(shared)}" if shared else " — no strategy in common"))
        for name in () if shared else (first_p[0], first_o[0]):
            r = by_name[name]
            terms = ", ".join(f"{k} {v / unit:.1f}" for k, v in r[f"planner_{where}_overlap_terms"].items() if v)
            lines.append(f"  {name:8} planner {r[f'planner_{where}_overlap'] / unit:8.1f} {unit_name} ({terms}); replay "
                         f"{r[replayed]['median'] / unit:8.1f} {unit_name}; {r['calls_per_step']:.0f} calls per step in "
                         f"the trace")
    shorter = [r["replay_here"]["median"] / r["replay_dgx_a100"]["median"] for r in fid["rows"]]
    lines.append(f"\na step replayed on the DGX-A100 node (a model) is {min(shorter):,.0f} to {max(shorter):,.0f} "
                 f"times shorter than replayed here")
    assert min(shorter) > 1
    return Shown("\n".join(lines))


def a100_ddp(tiny: dict, ranks: int) -> Shown:
    """§4: DDP's step (:func:`.time_model.traced_on_a100`'s result) on the A100 card: the step, its
    kernels × the launch floor, and its operators' seconds split three ways; the floor outweighs the rest."""
    split, card = tiny["split"], tiny["card"]
    spent = split["compute-bound"] + split["memory-bound"] + split["floor"]
    assert tiny["step"] >= tiny["floor"] and split["floor"] > split["compute-bound"] + split["memory-bound"]
    return Shown(f"DDP, the step model on {ranks} ranks, replayed on {card.name} (a model): the last step "
                 f"{tiny['step'] * 1e6:,.0f} us; rank {tiny['rank']} launches {tiny['kernels']} kernels in it x "
                 f"{card.launch_floor * 1e6:.0f} us = {tiny['floor'] * 1e6:,.0f} us\n"
                 "its operators: " + ", ".join(f"{k} {split[k] * 1e6:,.0f} us ({split[k] / spent:.0%})"
                                               for k in ("compute-bound", "memory-bound", "floor")))


def gpt3_split(big, card) -> Shown:
    """§4: the planner's best GPT-3 layout on a carded cluster, and one step of its first stage split
    like :func:`a100_ddp` (:func:`.time_model.planner_kernels`): the floor under 2 % of the step, compute-bound
    operators the most."""
    g = tm12.planner_kernels(GPT3_175B, big.layout, card)
    spent = g["compute-bound"] + g["memory-bound"] + g["floor"]
    assert big.fits and g["floor"] < 0.02 * big.step_seconds
    assert g["compute-bound"] > g["memory-bound"] + g["floor"]
    return Shown(f"planner's best on 128 nodes of {card.name} (device cards): {big}\n"
                 f"its first stage: {g['kernels']:,.0f} kernels x {card.launch_floor * 1e6:.0f} us = "
                 f"{g['floor']:.2f} s of a {big.step_seconds:.1f} s step ({g['floor'] / big.step_seconds:.1%}); "
                 + ", ".join(f"{k} {g[k]:.2f} s ({g[k] / spent:.0%})" for k in ("compute-bound", "memory-bound", "floor")))

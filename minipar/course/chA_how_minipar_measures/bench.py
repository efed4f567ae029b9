"""Appendix A: chapter 12's cost model against this course's own runs, and the cost model calibrated on this machine.

* :func:`compare_with_tour` runs tour rows (their strategies, their recipes) and puts what they measured
  beside :func:`minipar.plan.estimate` for the same layout: bytes each rank sent (the communication log)
  and memory (the measured peak).
* :func:`.calibration.calibrate` calibrates the cost model on this machine (α-β links, FLOP/s, the optimizer;
  :mod:`.calibration`, on :mod:`minipar.observe.measure`).
* :func:`step_times` really trains the step model with DDP, ZeRO-1/2/3, GPipe and 1F1B, TP and TP + SP on
  n ranks (:data:`.calibration.STEP_RANKS`: one per core, up to 4), calibrating again on the same ranks just before
  each, and predicts each step with :func:`minipar.plan.estimate` two ways: compute counted (FLOPs / the
  calibrated FLOP/s) and compute measured (the same step run with the wire cut,
  :func:`minipar.observe.wirecut.cut_wire`); and on the first calibration (one thread alone × the share of cores a
  rank gets) to show what that missed.

* :func:`measure_chapter` / ``python -m minipar bench steps``: every run the appendix's §2–4 show, made
  now and written with when and where to :data:`.recorded.RECORD`, which the chapter reads back.

    python -m minipar bench calibrate [--json] [--steps N]
    python -m minipar bench steps [--out FILE] [--runs N] [--steps N]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import time

from minipar import comm
from minipar.course.tour import strategies
from minipar.data.zero_memory import Precision
from minipar.launcher import launch
from minipar.models import GPTConfig
from minipar.observe.measure import RankSteps, gather_steps, timed_steps
from minipar.observe.wirecut import cut_wire
from minipar.plan import Cluster, Layout, Transformer, activation_bytes_per_layer, estimate
from minipar.tensor.sequence import uncounted_bytes

from .calibration import ALLREDUCE_SIZES, STEP_MODEL, STEP_RANKS, _contended, allreduce_link, calibrate, \
    calibrated_cluster, planner_options, step_layouts, step_recipe, train
from .gpu_bench import main as gpu_main
from .recorded import RECORD, as_record, provenance, provenance_text, write
from .replay_bench import fidelity_table, main as replay_main
from .time_model import traced_on_a100

__all__ = ["TOUR_LAYOUTS", "compare_with_tour", "calibrate", "step_times", "main", "steps_main",
           "measure_chapter", "BENCHMARKS"]

F64 = Precision(8, 8, 16)          # float64 Adam: parameter, gradient, two moments
_GPT = Transformer.from_config(GPTConfig(), 16)
_PIPE = Transformer.from_config(GPTConfig(n_layer=8, n_embd=16, n_head=2), 8)
_TP = Transformer.from_config(GPTConfig(n_embd=32, n_head=4, vocab_size=68), 16)
_LONG = Transformer.from_config(GPTConfig(n_layer=3, n_embd=64, block_size=64), 64)

# tour row name: (model, layout, precision, which bytes, how its memory was measured)
#   "peak": model states + the step's peak (what estimate's total is); "step": only what the step created
#   (activations, gradients, buffers); "layer": activation bytes of one layer; "peak, grads freed": the
#   step starts with gradients set to None (chapter 11), so persistent_grads=False; "bytes only": the row's
#   peak is not of this layout (DDP no_sync's is measured on a whole-batch step)
TOUR_LAYOUTS = {
    "DDP": (_GPT, Layout(dp=4, micro_batch=2), "fp32", "dp", "peak"),
    "ZeRO-1 ring": (_GPT, Layout(dp=4, micro_batch=2, zero=1), "fp32", "dp", "peak"),
    "ZeRO-2 ring": (_GPT, Layout(dp=4, micro_batch=2, zero=2), "fp32", "dp", "peak"),
    "ZeRO-3 ring": (_GPT, Layout(dp=4, micro_batch=2, zero=3), "fp32", "dp", "peak"),
    "DDP no_sync": (_GPT, Layout(dp=4, micro_batch=1, micro_batches=2), "fp32", "dp", "bytes only"),
    "ZeRO-1 gloo": (_GPT, Layout(dp=4, micro_batch=2, zero=1), "fp32", "dp", "peak"),
    "ZeRO-3 gloo": (_GPT, Layout(dp=4, micro_batch=2, zero=3), "fp32", "dp", "peak"),
    "pipeline GPipe": (_PIPE, Layout(pp=4, schedule="gpipe", micro_batch=2, micro_batches=8), F64, "pp", "step"),
    "pipeline 1F1B": (_PIPE, Layout(pp=4, micro_batch=2, micro_batches=8), F64, "pp", "step"),
    "pipeline zero bubble ZB-H1": (_PIPE, Layout(pp=4, schedule="zb-h1", micro_batch=2, micro_batches=8), F64,
                                   "pp", "step"),
    "pipeline interleaved 1F1B": (_PIPE, Layout(pp=4, v=2, schedule="interleaved", micro_batch=2, micro_batches=8),
                                  F64, "pp", "step"),
    "tensor parallel": (_TP, Layout(tp=4, micro_batch=4), "fp32", "tp", "layer"),
    "tensor parallel + sequence parallel": (_TP, Layout(tp=4, sp=True, micro_batch=4), "fp32", "tp", "layer"),
    "DDP + recompute none": (_LONG, Layout(dp=4, micro_batch=2), F64, "dp", "peak, grads freed"),
    "DDP + recompute selective": (_LONG, Layout(dp=4, micro_batch=2, recompute="selective"), F64, "dp",
                                  "peak, grads freed"),
    "DDP + recompute full": (_LONG, Layout(dp=4, micro_batch=2, recompute="full"), F64, "dp", "peak, grads freed"),
}
_CPU = Cluster(devices_per_node=4, nodes=1, memory_bytes=16e9, peak_flops=1e10, intra_bw=1e9, inter_bw=1e9)


def predict(name: str) -> dict:
    """The cost model's bytes and memory for the tour row ``name``, in the row's units."""
    model, layout, precision, key, how = TOUR_LAYOUTS[name]
    e = estimate(model, _CPU, layout, precision=precision, dropout=False, eager=True,
                 persistent_grads=how != "peak, grads freed")
    sent = e.bytes_sent[key] / (model.layers if key == "tp" else 1)        # the TP rows count one layer
    if how == "layer":                                                       # one layer's activations
        memory = activation_bytes_per_layer(model, layout.micro_batch, layout.tp, layout.sp, value_bytes=4,
                                            dropout=False) + uncounted_bytes(model.seq_len, layout.micro_batch,
                                                                             layout.tp, layout.sp)
    elif how == "bytes only":
        memory = None
    elif how == "step":
        memory = e.memory["activations"] + e.memory["grads"] + e.memory["buffers"]
    else:
        memory = e.memory["total"]
    return {"bytes": sent, "memory": memory, "estimate": e, "how": how}


def _measured_memory(row, how):
    if how == "bytes only":
        return None
    if how == "layer":
        found = re.search(r"activations per layer (\d+) B", row.note)
        return int(found.group(1)) if found else None
    return row.peak_bytes_per_rank


def compare_with_tour(names=None, run_row=None) -> list:
    """Run the tour rows ``names`` (default: all of :data:`TOUR_LAYOUTS`) and return one dict per row:
    strategy, bytes in the communication log (the algorithm's count: ``bytes_measured``) / observed on the
    sockets (``bytes_observed``) / predicted, memory measured / predicted, and what the memory is.
    ``run_row(name)``: where the rows come from instead (the tests pass rows their chapters' tests ran already)."""
    names = list(TOUR_LAYOUTS) if names is None else list(names)
    runs = {name: run for _, name, run in strategies() if name in names}
    missing = set(names) - set(runs)
    if missing:
        raise ValueError(f"no tour row named {sorted(missing)}; tour rows: {[n for _, n, _ in strategies()]}")
    out = []
    for name in names:
        row = runs[name]() if run_row is None else run_row(name)
        want = predict(name)
        out.append({"name": name, "strategy": row.strategy, "matches": row.matches, "bytes_measured": row.bytes_sent_per_rank,
                    "bytes_observed": row.bytes_observed_per_rank, "bytes_predicted": want["bytes"], "memory_measured": _measured_memory(row, want["how"]),
                    "memory_predicted": want["memory"], "memory_is": want["how"]})
    return out


# ---------------------------------------------------------------------------------------------------------
# Step times: the tour's strategies really run on n ranks vs predicted with the calibrated cluster
# ---------------------------------------------------------------------------------------------------------

def _timed_train(rank, world_size, name, steps, cut) -> RankSteps:
    """Strategy ``name`` trained ``steps`` steps on this rank, each optimizer step stamped
    (:func:`minipar.observe.measure.timed_steps`, untraced); its ``result``: the seconds per step spent inside
    minipar.comm's collectives, their logged seconds summed over the run / ``steps`` (waiting for the other
    ranks included; the set-up's broadcasts and the final gathering of parameters too, a few calls spread over
    the steps; an asynchronous call counts from launch to completion; send/recv not counted: a pipeline posts
    its receives early, so their seconds are mostly the bubble). With ``cut``, the same with the wire cut."""
    recipe = step_recipe(steps)
    with timed_steps(rank, traced=False) as run:
        with comm.recording() as log, cut_wire() if cut else contextlib.nullcontext():
            train(rank, world_size, name, run.stamped(recipe))
    run.result = sum(r.seconds for r in log.records if r.op not in ("send", "recv")) / steps
    return run


def _step_seconds(rank, world_size, names, steps, repeats, real=True):
    """{name: (RankSteps with the wire cut, RankSteps of the real run or None, the calibration taken just
    before)} on this rank. Right before each strategy, :func:`.calibration._contended` calibrates compute and the
    optimizer on the same ranks: the machine is shared, and what else runs on it changes from one second to the
    next."""
    out = {}
    for name in names:
        cal = _contended(rank, world_size, repeats)
        cut = _timed_train(rank, world_size, name, steps, cut=True)
        out[name] = (cut, _timed_train(rank, world_size, name, steps, cut=False) if real else None, cal)
    return out


def step_times(cal: dict, names=None, steps: int = 5, repeats: int = 3, measured: dict | None = None) -> list:
    """Run each strategy of :func:`step_layouts` (default all) on ``cal["ranks"]`` ranks and predict it.
    One dict per strategy: "name", "layout", "measured" (s/step, the slowest rank), "predicted"
    (:func:`estimate` on the cluster calibrated on the same ranks just before the run: α, β from ``cal``;
    compute = FLOPs / FLOP/s), "terms" (its time terms), "cut" (the step with the wire cut, slowest rank),
    "predicted_cut" (the same estimate with compute = "cut": FlexFlow's way), "terms_cut",
    "predicted_alone" (the first calibration: one thread alone × the share of cores), "in_comm" (seconds
    per step inside minipar.comm's collectives in the real run, the busiest rank: waits included). A step is
    the median of the run's steps, each timed on its slowest rank (:func:`minipar.observe.measure.gather_steps`),
    as in :func:`.replay_bench.fidelity_table`; "cut", an input (compute), the fastest of the cut run's steps.

    ``measured``: a :func:`.replay_bench.fidelity_table` of the same strategies — its "measured" column (the
    slowest rank's step, median over the steps, median [min–max] over its runs) is taken instead of a run of
    this function's own, which is then not made ("measured" is that median, "measured_spread" the spread,
    "in_comm" None): one measurement, one definition of a step, for every table that shows it."""
    n = cal.get("ranks", STEP_RANKS)
    layouts = step_layouts(n)
    names = list(layouts) if names is None else list(names)
    taken = None if measured is None else {r["name"]: r["measured"] for r in measured["rows"]}
    if taken is not None and (set(names) - set(taken) or measured["ranks"] != n):
        raise ValueError(f"the table measured {sorted(taken)} on {measured['ranks']} ranks; asked for {names} on {n}")
    ranks = launch(_step_seconds, n, names, steps, repeats, taken is None, quiet=True)
    out = []
    for name in names:
        layout = layouts[name]
        local = {k: sum(r[name][2][k] for r in ranks) / len(ranks) for k in ranks[0][name][2]}
        cluster = calibrated_cluster({**cal, **local}, n)
        kw = planner_options(layout)
        e = estimate(STEP_MODEL, cluster, layout, **kw)
        cut = gather_steps([r[name][0] for r in ranks]).fastest      # compute: the least disturbed cut step
        real = None if taken else gather_steps([r[name][1] for r in ranks])
        spread = taken[name] if taken else None
        c = estimate(STEP_MODEL, cluster, layout, compute_seconds=cut, **kw)
        alone = estimate(STEP_MODEL, calibrated_cluster(cal, n, contended=False), layout, **kw)
        out.append({"name": name, "layout": str(layout), "measured": spread["median"] if taken else real.median,
                    "measured_spread": spread,
                    "predicted": e.step_seconds, "terms": {k: v for k, v in e.time.items() if k != "total"},
                    "cut": cut, "predicted_cut": c.step_seconds,
                    "terms_cut": {k: v for k, v in c.time.items() if k != "total"},
                    "predicted_alone": alone.step_seconds, "calibration": local, "ranks": n,
                    "in_comm": None if taken else max(real.results)})
    return out


def main(argv=None) -> int:
    """The cost model calibrated on this machine (α-β links, FLOP/s, Adam), and the steps of eight strategies
    really trained beside its predictions."""
    parser = argparse.ArgumentParser(prog="python -m minipar bench calibrate")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--steps", type=int, default=5, help="training steps per strategy (default 5)")
    args = parser.parse_args(argv)
    if args.steps < 2:                             # a step is the gap between two optimizer steps
        parser.error(f"--steps must be at least 2, got {args.steps}")
    cal = calibrate()
    rows = step_times(cal, steps=args.steps)
    if args.json:
        print(json.dumps({"calibration": {**{k: v for k, v in cal.items() if k != "samples"},
                                          "samples": {str(k): v for k, v in cal["samples"].items()}},
                          "steps": rows}, indent=1))
        return 0
    print(f"alpha {cal['alpha'] * 1e6:.1f} us, beta {cal['beta'] / 1e9:.2f} GB/s; a rank's forward+backward "
          f"{cal['flops'] / 1e9:.2f} GFLOP/s while {cal['ranks']} compute (one thread alone, training: "
          f"{cal['alone_flops'] / 1e9:.2f}; bare matmul {cal['matmul_flops'] / 1e9:.1f}); Adam "
          f"{cal['optimizer_s_per_param'] * 1e9:.1f} ns/param; 4-byte all-reduce on {cal['ranks']} ranks "
          f"{cal['allreduce_small_s'] * 1e6:.0f} us")
    bw, hop = allreduce_link(cal, cal["ranks"])
    print(f"gloo's all-reduce on {cal['ranks']} ranks (median): " + ", ".join(
        f"{size} B {cal[f'allreduce_{size}_s'] * 1e3:.2f} ms" for size in ALLREDUCE_SIZES)
        + f"; fitted ring step: alpha {hop * 1e6:.0f} us, beta {bw / 1e9:.2f} GB/s")
    for n, t in cal["samples"].items():
        print(f"  {n:>9} B one way: {t * 1e6:9.1f} us   model {(cal['alpha'] + n / cal['beta']) * 1e6:9.1f} us")
    print(f"{cal['ranks']} ranks; measured / predicted with compute counted (FLOPs), with compute measured "
          f"(the wire cut), and with the first calibration")
    for r in rows:
        terms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["terms_cut"].items() if v)
        terms += f"; measured in collectives {r['in_comm'] * 1e3:.1f}"
        print(f"{r['name']:8} measured {r['measured'] * 1e3:7.1f} ms   counted {r['predicted'] * 1e3:7.1f} ms "
              f"x{r['measured'] / r['predicted']:.2f}   cut {r['predicted_cut'] * 1e3:7.1f} ms "
              f"x{r['measured'] / r['predicted_cut']:.2f} ({terms})   first x{r['measured'] / r['predicted_alone']:.2f}")
    return 0


def steps_main(argv=None) -> int:
    """``python -m minipar bench steps [--out FILE] [--runs 5] [--steps 3]``: every run appendix A's §2–4 show,
    made now and written to one JSON file with when and where (:mod:`.recorded`; the appendix reads
    :data:`.recorded.RECORD`). A few minutes on two cores."""
    parser = argparse.ArgumentParser(prog="python -m minipar bench steps")
    parser.add_argument("--out", default=str(RECORD), help=f"where to write (default {RECORD})")
    parser.add_argument("--runs", type=int, default=5, help="rounds of all eight strategies (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per strategy and run (default 3)")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.runs < 1:            # a step is the gap between two optimizer steps
        parser.error(f"--steps must be at least 2 and --runs at least 1, got {args.steps} and {args.runs}")
    record = measure_chapter(args.runs, args.steps, " ".join(["python -m minipar bench steps", *(argv or [])]))
    print(f"wrote {write(record, args.out)}: {provenance_text(record)}")
    return 0


def measure_chapter(runs: int = 5, steps: int = 3, command: str = "measure_chapter()") -> dict:
    """Every run appendix A's §2–4 show, made now (:func:`.recorded.as_record`): the two
    tensor-parallel tour rows, the calibration, ``runs`` rounds of the eight strategies measured and replayed,
    their step times predicted (compute counted and with the wire cut), DDP replayed on the A100 card."""
    started, load_before, load = time.time(), os.getloadavg(), {}    # load: the 1-min average as each part began
    load["tour rows"] = os.getloadavg()[0]
    tour = compare_with_tour(["tensor parallel", "tensor parallel + sequence parallel"])
    load["calibration"] = os.getloadavg()[0]
    cal = calibrate()
    load["measured and traced"] = os.getloadavg()[0]
    fid = fidelity_table(cal, runs=runs, steps=steps)
    load["wire cut"] = os.getloadavg()[0]
    rows = step_times(cal, steps=steps, repeats=2, measured=fid)
    load["operators counted"] = os.getloadavg()[0]
    a100 = traced_on_a100("DDP", steps=steps)
    meta = provenance(command, started, load_before)
    return as_record(tour, cal, fid, rows, a100, {**meta, "load_by_part": {k: round(v, 1) for k, v in load.items()}})


BENCHMARKS = {"calibrate": main, "replay": replay_main, "gpu": gpu_main, "steps": steps_main}

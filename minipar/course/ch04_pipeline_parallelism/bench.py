"""minipar's pipeline runtime against ``torch.distributed.pipelining``: same stages, same batch, 4 CPU ranks.

    python -m minipar bench pipeline                          # 1F1B, m = 8
    python -m minipar bench pipeline --schedule interleaved   # v = 2
    python -m minipar bench pipeline --schedule gpipe --m 4
    python -m minipar bench pipeline --paced --json           # idle: paced runs vs the simulator

Each optimizer step (zero_grad, the schedule's forwards and backwards with their point-to-point messages,
Adam step) is timed on every rank between barriers by :func:`minipar.bench.alternating_medians`, the two
implementations alternating step by step on separate copies of the same stages (the tiny GPT).

On a 2-core machine 4 ranks share the cores: step times include contention; trust the ratio of medians
measured side by side, not the absolute figures.

``--paced`` measures the schedules instead of the implementations: GPipe, 1F1B and interleaved (v = 2) on 4
ranks, m = 8, each action held to a calibrated slot (:mod:`minipar.pipeline.paced`), and prints per
schedule the measured idle fraction (median over the steps after the first) beside the simulator's for the
same slot lengths (``--json``: one JSON object per line). ``--unpaced`` adds the same runs without pacing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from minipar.course.bench import alternating_medians

__all__ = ["bench_rank", "idle_report", "main"]

PACED_SHOWN = [("gpipe", 8, 1), ("1f1b", 8, 1), ("interleaved", 8, 2)]


def bench_rank(rank, world_size, schedule="1f1b", m=8, v=1, layers=8, embd=64, batch=32, seq=32, iters=20,
               warmup=3):
    from torch.distributed import pipelining

    from minipar.check import gpt_recipe
    from minipar.mesh import Mesh
    from minipar.pipeline.runtime import PipelineRank, synced_clock
    from minipar.pipeline.schedules import make_schedule
    from minipar.pipeline.stages import assign, boundary_shapes, split_model, stage_loss
    from minipar.pipeline.torch_ref import TORCH_SCHEDULES

    mesh = Mesh(world_size, pp=world_size).build(rank)
    recipe = gpt_recipe(steps=1, batch_size=batch, seq_len=seq, n_layer=layers, n_embd=embd, n_head=4)
    x, y = recipe.batches[0]
    p = world_size

    ours_all = split_model(recipe.model(), p * v)
    ours = assign(ours_all, p, rank)
    runner = PipelineRank(make_schedule(schedule, p, m, v), ours, mesh,
                          boundary_shapes(ours_all, x[: batch // m]), t0=synced_clock(mesh.group("pp")))
    ours_opt = torch.optim.Adam([q for s in ours.values() for q in s.parameters()], lr=1e-3)

    theirs = assign(split_model(recipe.model(), p * v), p, rank)
    stages = [pipelining.PipelineStage(s, s.index, p * v, torch.device("cpu"), group=mesh.group("pp"))
              for s in theirs.values()]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    sched = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=stage_loss)
    theirs_opt = torch.optim.Adam([q for s in theirs.values() for q in s.parameters()], lr=1e-3)

    def ours_step():
        ours_opt.zero_grad(set_to_none=True)
        runner.run(list(x.chunk(m)), list(y.chunk(m)))
        ours_opt.step()

    def theirs_step():
        theirs_opt.zero_grad(set_to_none=True)
        args = (x,) if 0 in theirs else ()
        kwargs = {"target": y} if p * v - 1 in theirs else {}
        sched.step(*args, **kwargs)
        theirs_opt.step()

    return alternating_medians({"minipar": ours_step, "torch.distributed.pipelining": theirs_step},
                               iters=iters, warmup=warmup)


def paced_recipe(steps: int = 4):
    """The runs behind ``--paced``: tiny GPT, 8 blocks, hidden 32, sequence 8, global batch 16."""
    from minipar.check import gpt_recipe
    return gpt_recipe(steps=steps, batch_size=16, seq_len=8, n_layer=8, n_embd=32, n_head=2)


def idle_counting_transfers(runs: list, step: int) -> float:
    """Idle fraction of ``step`` if each action began when its input *arrived* (after the transfer and the
    waiting rank's wake-up) rather than when it was sent: what pacing leaves out, shown beside it."""
    from minipar.pipeline.timeline import step_rows
    work = step_rows(runs, step)
    waits = step_rows(runs, step, kinds=("wait",))
    busy = 0.0
    for rank, kind, stage, mb, a, b in work:
        arrived = [w[5] for w in waits if w[0] == rank and w[2] == stage and w[3] == mb and a - 1e-9 <= w[5] <= b]
        busy += b - max([a] + arrived)
    return 1 - busy / (len(runs) * max(r[5] for r in work))


def idle_report(name: str, m: int, v: int, runs: list, p: int = 4) -> dict:
    """Measured idle (median over the steps after the first, which also allocates) beside the simulator's
    for the run's slot lengths (paced) or for F = B = W = 1 (unpaced)."""
    from minipar.pipeline.timeline import measured_idle_fraction
    from minipar.pipeline.schedules import bubble_formula, make_schedule
    from minipar.pipeline.simulate import Costs, simulate
    steps = sorted({row[0] for row in runs[0].timeline})[1:]
    per_step = [measured_idle_fraction(runs, s) for s in steps]
    pace = runs[0].pace
    sim = simulate(make_schedule(name, p, m, v), pace.costs(v) if pace else Costs())
    out = {"schedule": name, "p": p, "m": m, "v": v, "paced": pace is not None,
           "measured_idle": round(statistics.median(per_step), 4), "simulated_idle": round(sim.bubble_fraction, 4),
           "measured_idle_per_step": [round(x, 4) for x in per_step],
           "formula_idle": round(bubble_formula(name, p, m, v), 4)}
    if pace:
        out["measured_idle_counting_transfers"] = round(statistics.median(
            idle_counting_transfers(runs, s) for s in steps), 4)
        out["slot_ms"] = {"F": round(1e3 * pace.F, 1), "B": round(1e3 * pace.B, 1), "W": round(1e3 * pace.W, 1)}
        out["overruns"] = sum(r.overruns for r in runs)
    return out


def paced_main(args) -> int:
    from minipar.pipeline import runtime
    recipe = paced_recipe()
    modes = [({"min_slot": args.min_slot_ms / 1e3} if args.slot_ms is None else _fixed_pace(args.slot_ms))] + ([None] if args.unpaced else [])
    for pace in modes:
        for name, m, v in PACED_SHOWN:
            runs = runtime.run(recipe, world_size=4, schedule=name, m=m, v=v, pace=pace)
            rep = idle_report(name, m, v, runs)
            rep["load_average_1min"] = round(os.getloadavg()[0], 1)
            if args.json:
                print(json.dumps(rep), flush=True)
            else:
                print(f"{name:12s} {'paced' if pace else 'unpaced':8s} measured idle {rep['measured_idle']:6.1%}"
                      f"   simulated {rep['simulated_idle']:6.1%}   (load average {rep['load_average_1min']})",
                      flush=True)
    return 0


def _fixed_pace(ms: float):
    from minipar.pipeline.paced import Pace
    return Pace(ms / 1e3, ms / 1e3, ms / 1e3)


def main(argv=None) -> int:
    from minipar.launcher import launch
    from minipar.pipeline.schedules import validate
    parser = argparse.ArgumentParser(prog="python -m minipar bench pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--v", type=int, default=None, help="chunks per rank (interleaved: 2)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--paced", action="store_true", help="idle fractions of paced runs vs the simulator")
    parser.add_argument("--unpaced", action="store_true", help="with --paced: the same runs unpaced too")
    parser.add_argument("--slot-ms", type=float, default=None,
                        help="with --paced: fixed slots F = B = W (ms) instead of calibrated ones")
    parser.add_argument("--min-slot-ms", type=float, default=40.0,
                        help="with --paced: calibrated slots, the shortest this long (ms)")
    parser.add_argument("--json", action="store_true", help="with --paced: one JSON object per schedule")
    args = parser.parse_args(argv)
    if args.paced:
        return paced_main(args)
    v = args.v or (2 if args.schedule == "interleaved" else 1)
    validate(args.schedule, args.ranks, args.m, v, n_layers=8)
    results = launch(bench_rank, args.ranks, args.schedule, args.m, v, iters=args.iters, quiet=True,
                     timeout=120)
    medians = results[0]
    ours, theirs = medians["minipar"], medians["torch.distributed.pipelining"]
    print(f"{args.schedule} p={args.ranks} m={args.m} v={v}, tiny GPT 8 blocks, hidden 64, batch 32 x 32 tokens")
    print(f"  minipar                       median step {1e3 * ours:8.1f} ms")
    print(f"  torch.distributed.pipelining  median step {1e3 * theirs:8.1f} ms")
    print(f"  ratio minipar / torch: {ours / theirs:.2f}")
    return 0


BENCHMARKS = {"pipeline": main}

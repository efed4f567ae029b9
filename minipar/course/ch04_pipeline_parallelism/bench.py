"""minipar's pipeline runtime against ``torch.distributed.pipelining``: same stages, same batch, 4 CPU ranks.

    python -m minipar bench pipeline                          # 1F1B, m = 8
    python -m minipar bench pipeline --schedule interleaved   # v = 2
    python -m minipar bench pipeline --schedule gpipe --m 4

Each optimizer step (zero_grad, the schedule's forwards and backwards with their point-to-point messages,
Adam step) is timed on every rank between barriers by :func:`minipar.bench.alternating_medians`, the two
implementations alternating step by step on separate copies of the same stages (the tiny GPT).

On a 2-core machine 4 ranks share the cores: step times include contention; trust the ratio of medians
measured side by side, not the absolute figures.
"""
from __future__ import annotations

import argparse

import torch

from minipar.course.bench import alternating_medians

__all__ = ["bench_rank", "main"]


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


def main(argv=None) -> int:
    from minipar.launcher import launch
    from minipar.pipeline.schedules import validate
    parser = argparse.ArgumentParser(prog="python -m minipar bench pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--v", type=int, default=None, help="chunks per rank (interleaved: 2)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args(argv)
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

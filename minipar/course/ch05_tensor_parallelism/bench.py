"""minipar's tensor-parallel MLP against PyTorch's DTensor TP on the same MLP, 4 CPU ranks, alternating.

    python -m minipar bench tp                      # medians and ratio (minipar / DTensor)
    python -m minipar bench tp --hidden 512 --iters 30

The model is the transformer MLP, Linear(h → 4h) · GeLU · Linear(4h → h), split column then row: minipar's
:class:`~minipar.tensor.layers.TensorParallelMLP` (f and g placed by hand) and the same weights through
``parallelize_module(..., {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})``. Each step
(zero_grad, forward, backward, SGD step) is timed on every rank between barriers by
:func:`minipar.bench.alternating_medians`, the two alternating step by step. Both move the same bytes (one
all-reduce of b·s·h forward, one backward); the difference is DTensor's dispatch overhead.

On a 2-core machine 4 ranks share the cores: trust the ratio of medians measured side by side, not the
absolute figures.
"""
from __future__ import annotations

import argparse

import torch

from minipar.course.bench import alternating_medians

__all__ = ["bench_rank", "run", "main"]


def bench_rank(rank, world_size, hidden=256, batch=8, seq=64, iters=20, warmup=3):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from minipar import comm
    from minipar.mesh import Mesh
    from minipar.models import MLP
    from minipar.tensor.layers import TensorParallelMLP

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    sizes = (hidden, 4 * hidden, hidden)
    ref, theirs = MLP(sizes, seed=0), MLP(sizes, seed=0)
    ours = TensorParallelMLP(ref.layers[0], ref.layers[1], group)
    parallelize_module(theirs, DeviceMesh.from_group(group, "cpu"),
                       {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})
    # the input needs a gradient, as inside a network: backward then all-reduces dX (f)
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(1)).requires_grad_(True)

    def step_fn(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()
        return step

    steps = {"minipar TP": step_fn(ours), "DTensor TP": step_fn(theirs)}
    with comm.recording() as log:
        steps["minipar TP"]()
    medians = alternating_medians(steps, iters=iters, warmup=warmup)
    return {"medians": medians, "bytes_sent": log.bytes_sent, "all_reduces": log.count("all_reduce")}


def run(world_size=4, **kwargs) -> dict:
    from minipar.launcher import launch
    results = launch(bench_rank, world_size, quiet=True, **kwargs)
    medians = {name: max(r["medians"][name] for r in results) for name in results[0]["medians"]}
    return {"medians": medians, "ratio": medians["minipar TP"] / medians["DTensor TP"],
            "bytes_sent": results[0]["bytes_sent"], "all_reduces": results[0]["all_reduces"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar bench tp", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    out = run(args.ranks, hidden=args.hidden, batch=args.batch, seq=args.seq, iters=args.iters)
    print(f"MLP {args.hidden} -> {4 * args.hidden} -> {args.hidden}, batch {args.batch} x {args.seq} tokens, "
          f"{args.ranks} ranks; one step: {out['all_reduces']} all-reduces, {out['bytes_sent']} bytes sent per rank")
    for name, sec in out["medians"].items():
        print(f"  {name:12} median step {sec * 1e3:8.2f} ms")
    print(f"  ratio minipar / DTensor = {out['ratio']:.2f} (target <= 1.0)")
    return 0


BENCHMARKS = {"tp": main}

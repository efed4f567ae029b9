"""minipar's tensor-parallel MLP against PyTorch's DTensor TP on the same MLP, 4 CPU ranks, alternating.

    python -m minipar bench tp                      # medians and ratio (minipar / DTensor)
    python -m minipar bench tp --hidden 512 --iters 30

The model is the transformer MLP, Linear(h → 4h) · GeLU · Linear(4h → h), split column then row: minipar's
:class:`~minipar.tensor.layers.TensorParallelMLP` (f and g placed by hand) and the same weights through
``parallelize_module(..., {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})``. Each step
(zero_grad, forward, backward, SGD step) is timed on every rank between barriers by
:func:`minipar.bench.alternating_medians`, the two alternating step by step. Both should move the same bytes
(one all-reduce of b·s·h forward, one backward): one step of each is *observed* on the wire
(:mod:`minipar.wire`, what this process wrote to its sockets) and printed beside the ring formula, so the
claim is checked, not assumed (DTensor's collectives bypass minipar's log; the wire sees them).

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
    for step in steps.values():                    # warm-up: lazy allocations and DTensor's caches
        step()
    observed = {}
    for name, step in steps.items():
        torch.distributed.barrier(group)
        with comm.recording() as log:
            step()
        observed[name] = log.observed_bytes_sent
        if name == "minipar TP":
            logged, calls = log.bytes_sent, log.count("all_reduce")
    medians = alternating_medians(steps, iters=iters, warmup=warmup)
    formula = 2 * comm.predicted_bytes_sent("all_reduce", batch * seq * hidden * 4, world_size)
    return {"medians": medians, "bytes_sent": logged, "all_reduces": calls, "observed": observed,
            "formula": formula}


def run(world_size=4, **kwargs) -> dict:
    from minipar.launcher import launch
    results = launch(bench_rank, world_size, quiet=True, **kwargs)
    medians = {name: max(r["medians"][name] for r in results) for name in results[0]["medians"]}
    return {"medians": medians, "ratio": medians["minipar TP"] / medians["DTensor TP"],
            "bytes_sent": results[0]["bytes_sent"], "all_reduces": results[0]["all_reduces"],
            "observed": [r["observed"] for r in results], "formula": results[0]["formula"]}


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
    print(f"  bytes per rank per step: formula 2 all-reduces x 2(N-1)/N x b*s*h*4 = {out['formula']:,.0f}; "
          f"minipar's log {out['bytes_sent']:,}")
    for name in out["medians"]:
        seen = [o[name] for o in out["observed"]]
        text = ", ".join("n/a" if b is None else f"{b:,}" for b in seen)
        print(f"  {name:12} observed on the wire, ranks 0..{args.ranks - 1}: {text}")
    for name, sec in out["medians"].items():
        print(f"  {name:12} median step {sec * 1e3:8.2f} ms")
    print(f"  ratio minipar / DTensor = {out['ratio']:.2f} (target <= 1.0)")
    return 0


BENCHMARKS = {"tp": main}

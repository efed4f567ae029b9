"""minipar's ZeRO-3 against PyTorch's FSDP2 (``fully_shard``): same model, same batch, same units (one per
transformer block + the root), Adam, 4 CPU ranks, alternating.

    python -m minipar bench zero                       # medians and ratio (target: minipar / torch <= 1.1)
    python -m minipar bench zero --layers 4 --embd 128 --iters 20

Each optimizer step (zero_grad, forward with the all-gathers, backward with the all-gathers and
reduce-scatters, Adam on the shards) is timed on every rank between barriers by
:func:`minipar.bench.alternating_medians`, the two implementations alternating step by step. FSDP2 keeps the
root's parameters gathered between forward and backward (it does not reshard the root after forward);
minipar reshards every unit, so it all-gathers the root once more per step (printed below).

On a 2-core machine 4 ranks share the cores: step times are noisy and include contention; trust the
ratio of medians measured side by side, not the absolute figures.
"""
from __future__ import annotations

import argparse

from minipar.loop import lm_loss
from minipar.course.bench import alternating_medians, model_and_batch

__all__ = ["bench_rank", "run", "main"]


def _loss(model, x, y):
    logits = model(x)
    return lm_loss(logits, y)


def bench_rank(rank, world_size, layers=4, embd=128, batch=16, seq=64, iters=20, warmup=3):
    """On each rank: {name: median step seconds} and the bytes minipar's step sent."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from minipar import comm
    from minipar.data import fsdp

    make, (x, y) = model_and_batch(layers, embd, batch, seq)
    per = batch // world_size
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731

    ours_model = make()
    ours = fsdp.fully_shard(ours_model, adam, fsdp.block_units)

    def ours_step():
        ours.zero_grad()
        _loss(ours_model, x, y).backward()
        ours.step()

    mesh = init_device_mesh("cpu", (world_size,))
    torch_model = make()
    for unit in fsdp.block_units(torch_model):
        fully_shard(unit, mesh=mesh)
    torch_opt = adam(torch_model.parameters())

    def torch_step():
        torch_opt.zero_grad(set_to_none=True)
        _loss(torch_model, x, y).backward()
        torch_opt.step()

    medians = alternating_medians({"minipar ZeRO-3": ours_step, "torch FSDP2": torch_step}, iters, warmup)
    with comm.recording() as log:
        ours_step()
    return {"medians": medians, "bytes_sent": log.bytes_sent, "numel": ours.numel}


def run(world_size=4, **kwargs) -> dict:
    from minipar.launcher import launch
    results = launch(bench_rank, world_size, quiet=True, timeout=300, **kwargs)
    return results[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar bench zero", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if args.batch % args.ranks:
        raise ValueError(f"--batch {args.batch} does not split evenly over {args.ranks} ranks")
    res = run(args.ranks, layers=args.layers, embd=args.embd, batch=args.batch, seq=args.seq, iters=args.iters)
    m = res["medians"]
    print(f"TinyGPT {args.layers}L/{args.embd}h, Ψ = {res['numel']:,} parameters, Adam, {args.ranks} CPU ranks, "
          f"global batch {args.batch}x{args.seq}, {args.iters} alternating steps")
    for name, sec in m.items():
        print(f"  {name:<16} median {1e3 * sec:8.1f} ms/step")
    print(f"  ratio minipar / torch = {m['minipar ZeRO-3'] / m['torch FSDP2']:.2f}  (target <= 1.1)")
    print(f"  minipar sent {res['bytes_sent']:,} B per rank per step")
    return 0


BENCHMARKS = {"zero": main}

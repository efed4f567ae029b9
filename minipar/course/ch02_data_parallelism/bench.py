"""minipar's DDP against PyTorch's DistributedDataParallel: same model, same batch, 4 CPU ranks, alternating.

    python -m minipar bench ddp                     # medians, ratio, bucket size
    python -m minipar bench ddp --with-dp           # also DataParallel (threads) and DDP without comm

Each optimizer step (zero_grad, forward, backward with the gradient all-reduce, SGD step) is timed on every
rank between barriers by :func:`minipar.bench.alternating_medians`, the two implementations alternating
step by step. Both use the same bucket capacity. With ``--with-dp`` rank 0 also times a DataParallel step
over 4 thread-driven replicas of the same model on the same global batch (the other ranks wait at the
barrier), and every rank times a DDP step under ``no_sync`` (the compute alone, no communication): the
numbers the chapter's DP-vs-DDP table and its slow-link model are built from.

On a 2-core machine 4 ranks share the cores: step times are noisy and include contention; trust the
ratio of medians measured side by side, not the absolute figures, and look at the spread of the ratio
over ``--repeats`` independent runs (the median run is reported).
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn as nn
from minipar.loop import lm_loss

from minipar.course.bench import alternating_medians, model_and_batch

__all__ = ["bench_rank", "run", "main"]


def _step_fn(model, opt, x, y, sync=True):
    def step():
        opt.zero_grad(set_to_none=True)
        with contextlib.nullcontext() if sync else model.no_sync():
            logits = model(x)
            lm_loss(logits, y).backward()
        opt.step()
    return step


def bench_rank(rank, world_size, layers=4, embd=128, batch=16, seq=64, bucket_mb=1.0, iters=20, warmup=3,
               with_dp=False, repeats=1):
    """On each rank: {name: median step seconds} plus the gradient bytes and the step's comm bytes."""
    from minipar import comm
    from minipar.data import ddp, dp
    from minipar.loop import shard_batch

    make, (x, y) = model_and_batch(layers, embd, batch, seq)
    xs, ys = shard_batch((x, y), rank, world_size)
    bucket_bytes = int(bucket_mb * 2**20)
    ours_model, torch_model = make(), make()
    ours = ddp.DistributedDataParallel(ours_model, bucket_bytes=bucket_bytes)
    theirs = nn.parallel.DistributedDataParallel(torch_model, bucket_cap_mb=bucket_mb)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.01)  # noqa: E731
    steps = {"minipar DDP": _step_fn(ours, sgd(ours_model), xs, ys),
             "torch DDP": _step_fn(theirs, sgd(torch_model), xs, ys)}
    if with_dp:
        steps["DDP compute only (no_sync)"] = _step_fn(ours, sgd(ours_model), xs, ys, sync=False)
        dp_model = make()
        data_parallel = dp.DataParallel(dp_model, ["cpu"] * world_size)
        dp_step = _step_fn(data_parallel, sgd(dp_model), x, y)
        steps["DP threads (rank 0 alone)"] = dp_step if rank == 0 else (lambda: None)
    with comm.recording() as log:
        steps["minipar DDP"]()
    runs = [alternating_medians(steps, iters=iters, warmup=warmup) for _ in range(repeats)]
    medians = {name: sorted(r[name] for r in runs)[len(runs) // 2] for name in steps}
    grad_bytes = sum(p.numel() * p.element_size() for p in ours_model.parameters())
    dp_bytes = None
    if with_dp and rank == 0:
        data_parallel.log = dp.ExchangeLog()
        dp_step()
        dp_bytes = data_parallel.log.by_exchange()
    return {"medians": medians, "runs": runs, "grad_bytes": grad_bytes, "step_bytes_sent": log.bytes_sent,
            "buckets": len(ours.reducer.buckets), "all_reduces": log.count("all_reduce"), "dp_bytes": dp_bytes}


def run(world_size=4, quiet=True, **kwargs) -> dict:
    """Launch :func:`bench_rank` on ``world_size`` ranks; rank 0's figures (the barrier makes every
    rank's median the slowest rank's step)."""
    from minipar.launcher import launch
    return launch(bench_rank, world_size, quiet=quiet, timeout=120, **kwargs)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipar bench ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="independent alternating runs (median shown)")
    parser.add_argument("--with-dp", action="store_true")
    a = parser.parse_args(argv)
    out = run(a.ranks, layers=a.layers, embd=a.embd, batch=a.batch, seq=a.seq, bucket_mb=a.bucket_mb,
              iters=a.iters, with_dp=a.with_dp, repeats=a.repeats)
    m = out["medians"]
    print(f"TinyGPT {a.layers}L/{a.embd}h, global batch {a.batch}x{a.seq} on {a.ranks} CPU ranks (gloo), "
          f"gradients {out['grad_bytes'] / 2**20:.2f} MiB, bucket {a.bucket_mb:g} MiB "
          f"({out['buckets']} buckets, {out['all_reduces']} all-reduces/step), {a.repeats} runs of {a.iters} "
          f"alternating steps")
    for name, sec in m.items():
        print(f"  {name:<28} median step {sec * 1e3:8.2f} ms")
    ratios = sorted(r["minipar DDP"] / r["torch DDP"] for r in out["runs"])
    ratio = ratios[len(ratios) // 2]
    print(f"  ratio minipar / torch per run: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"  ratio minipar / torch = {ratio:.3f} (median run; {'within' if ratio <= 1.05 else 'ABOVE'} the 1.05 "
          f"target)")
    return 0


BENCHMARKS = {"ddp": main}

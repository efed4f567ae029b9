"""minipar's DDP against PyTorch's DistributedDataParallel: same model, same batch, 4 CPU ranks, alternating.

    python -m minipar bench ddp                     # medians, ratio, bucket size
    python -m minipar bench ddp --with-dp           # also DataParallel (threads) and DDP without comm
    python -m minipar bench ddp --sweep [--json]    # bucket sizes vs one bucket (no overlap)
    python -m minipar bench ddp --where             # CPU per step by phase: where the ratio comes from

Each optimizer step (zero_grad, forward, backward with the gradient all-reduce, SGD step) is timed on every
rank between barriers by :func:`minipar.bench.alternating_medians`, the implementations alternating
step by step. All use the same bucket capacity. minipar's gradients are views into its buckets (its
:mod:`minipar.data.ddp`: no copy in or out of a bucket), as PyTorch's with ``gradient_as_bucket_view=True``:
that PyTorch DDP is the like-for-like reference the ratio is computed against ("torch DDP (bucket view)").
PyTorch's default (``gradient_as_bucket_view=False``: gradients copied into the bucket and back) is timed
beside it as an extra column ("torch DDP (default)"), and its ratio printed too. With ``--with-dp`` rank 0 also times a DataParallel step
over 4 thread-driven replicas of the same model on the same global batch (the other ranks wait at the
barrier), and every rank times a DDP step under ``no_sync`` (the compute alone, no communication): the
chapter's DP-vs-DDP timing, measured (:func:`describe_run` prints it).

On a 2-core machine 4 ranks share the cores: step times are noisy and include contention; trust the
ratio of medians measured side by side, not the absolute figures, and look at the spread of the ratio
over ``--repeats`` independent runs (the median run is reported).

``--sweep`` times minipar's DDP at several bucket sizes, the configurations alternating step by step in one
launch, against a single bucket holding every gradient — whose all-reduce can only start once backward has
produced the last gradient: the *no-overlap baseline*. Per configuration: the median step time (slowest
rank, between barriers), the share of the all-reduce time (each bucket from its launch to the completion
of its work) that passed while this rank was still computing gradients (*hidden*), and the *exposed* time
from the last gradient to the end of backward (communication nothing hid). Medians over steps and ranks.
On 2 shared cores a collective also waits for the slowest rank to join, which counts as communication.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.nn as nn
from minipar.loop import lm_loss

from minipar.course.bench import alternating_medians, model_and_batch

__all__ = ["bench_rank", "run", "sweep_rank", "sweep", "describe_run", "describe_sweep", "main", "ratios",
           "TORCH_VIEW", "TORCH_DEFAULT"]

TORCH_VIEW = "torch DDP (bucket view)"      # gradient_as_bucket_view=True: minipar's design, the reference
TORCH_DEFAULT = "torch DDP (default)"       # gradient_as_bucket_view=False: PyTorch's default, copies


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
    """On each rank: {name: median step seconds} plus the gradient bytes and the step's comm bytes
    (``iters=0``: the bytes alone, nothing timed)."""
    from minipar import comm
    from minipar.data import ddp, dp
    from minipar.loop import shard_batch

    make, (x, y) = model_and_batch(layers, embd, batch, seq)
    xs, ys = shard_batch((x, y), rank, world_size)
    bucket_bytes = int(bucket_mb * 2**20)
    ours_model, view_model, default_model = make(), make(), make()
    ours = ddp.DistributedDataParallel(ours_model, bucket_bytes=bucket_bytes)
    theirs = nn.parallel.DistributedDataParallel(view_model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    theirs_default = nn.parallel.DistributedDataParallel(default_model, bucket_cap_mb=bucket_mb)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.01)  # noqa: E731
    steps = {"minipar DDP": _step_fn(ours, sgd(ours_model), xs, ys),
             TORCH_VIEW: _step_fn(theirs, sgd(view_model), xs, ys),
             TORCH_DEFAULT: _step_fn(theirs_default, sgd(default_model), xs, ys)}
    if with_dp:
        steps["DDP compute only (no_sync)"] = _step_fn(ours, sgd(ours_model), xs, ys, sync=False)
        dp_model = make()
        data_parallel = dp.DataParallel(dp_model, ["cpu"] * world_size)
        dp_step = _step_fn(data_parallel, sgd(dp_model), x, y)
        steps["DP threads (rank 0 alone)"] = dp_step if rank == 0 else (lambda: None)
    with comm.recording() as log:
        steps["minipar DDP"]()
    runs = [alternating_medians(steps, iters=iters, warmup=warmup) for _ in range(repeats)] if iters else []
    medians = {name: sorted(r[name] for r in runs)[len(runs) // 2] for name in steps} if runs else {}
    grad_bytes = sum(p.numel() * p.element_size() for p in ours_model.parameters())
    dp_bytes = None
    if with_dp and rank == 0:
        data_parallel.log = dp.ExchangeLog()
        dp_step()
        dp_bytes = data_parallel.log.by_exchange()
    return {"medians": medians, "runs": runs, "grad_bytes": grad_bytes, "step_bytes_sent": log.bytes_sent,
            "buckets": len(ours.reducer.buckets), "all_reduces": log.count("all_reduce"), "dp_bytes": dp_bytes}


def sweep_rank(rank, world_size, bucket_sizes=(16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024), layers=2, embd=64, batch=16,
               seq=32, iters=10, warmup=2):
    """On each rank, per configuration (the bucket sizes, then "one bucket"): lists of step seconds,
    hidden fractions and exposed seconds over the timed steps; and the gradient bytes."""
    import torch.distributed as dist
    from minipar.data import ddp
    from minipar.data.ddp_measure import watch_buckets
    from minipar.loop import shard_batch

    from .figures import overlap_fraction
    make, (x, y) = model_and_batch(layers, embd, batch, seq)
    xs, ys = shard_batch((x, y), rank, world_size)
    grad_bytes = sum(p.numel() * p.element_size() for p in make().parameters())
    configs = {f"{b // 1024} KiB buckets": b for b in bucket_sizes if b < grad_bytes}
    configs["one bucket (no overlap)"] = 2 * grad_bytes
    runs = {}
    for name, size in configs.items():
        model = make()
        wrapped = ddp.DistributedDataParallel(model, bucket_bytes=size)
        runs[name] = (wrapped, watch_buckets(wrapped), torch.optim.SGD(model.parameters(), lr=0.01))
    out = {name: {"step": [], "hidden": [], "exposed": [], "buckets": len(runs[name][0].reducer.buckets)}
           for name in configs}
    names = list(configs)
    for i in range(warmup + iters):
        for name in (names if i % 2 == 0 else names[::-1]):
            wrapped, events, opt = runs[name]
            opt.zero_grad(set_to_none=True)
            events.clear()
            dist.barrier()
            t0 = time.perf_counter()
            lm_loss(wrapped(xs), ys).backward()          # returns once every bucket is reduced
            t_backward = time.perf_counter()
            opt.step()
            dist.barrier()
            t1 = time.perf_counter()
            time.sleep(0.002)                             # let the last completion callbacks land
            if i >= warmup:
                last_grad = max(a for k, _, a, _ in events if k == "grad")
                out[name]["step"].append(t1 - t0)
                out[name]["hidden"].append(overlap_fraction(list(events)))
                out[name]["exposed"].append(t_backward - last_grad)
    return {"configs": out, "grad_bytes": grad_bytes, "bucket_bytes": configs}


def sweep(world_size=4, quiet=True, **kwargs) -> list:
    """Launch :func:`sweep_rank`; one row per configuration: median step ms (rank 0: the barriers make it
    the slowest rank's), median hidden fraction and exposed ms over steps and ranks."""
    from minipar.launcher import launch
    per_rank = launch(sweep_rank, world_size, quiet=quiet, timeout=300, **kwargs)
    rows = []
    for name, size in per_rank[0]["bucket_bytes"].items():
        mine = [r["configs"][name] for r in per_rank]
        rows.append({"config": name, "bucket_bytes": size, "buckets": mine[0]["buckets"],
                     "grad_bytes": per_rank[0]["grad_bytes"],
                     "step_ms": round(1e3 * statistics.median(mine[0]["step"]), 2),
                     "hidden_fraction": round(statistics.median(h for m in mine for h in m["hidden"]), 3),
                     "exposed_ms": round(1e3 * statistics.median(e for m in mine for e in m["exposed"]), 2)})
    return rows


def ratios(runs: list, torch_name: str = TORCH_VIEW) -> list:
    """minipar's median step over ``torch_name``'s, per run of :func:`bench_rank`, sorted."""
    return sorted(r["minipar DDP"] / r[torch_name] for r in runs)


def run(world_size=4, quiet=True, **kwargs) -> dict:
    """Launch :func:`bench_rank` on ``world_size`` ranks; rank 0's figures (the barrier makes every
    rank's median the slowest rank's step)."""
    from minipar.launcher import launch
    return launch(bench_rank, world_size, quiet=quiet, timeout=120, **kwargs)[0]


def describe_run(m: dict) -> str:
    """The medians of :func:`run` (``with_dp=True``) as lines, with the bytes each way moves per step."""
    dp_out = (m["dp_bytes"] or {}).get("replicate model", 0)         # device 0's weights out; as many back
    lines = [f"{name:<28} median step {1e3 * sec:7.1f} ms" for name, sec in m["medians"].items()]
    lines.append(f"gradients {m['grad_bytes']:,} B; DDP: each rank sends {m['step_bytes_sent']:,.0f} B per step; "
                 f"DP (star): device 0 sends {dp_out:,} B of weights (and receives as many of gradients)")
    return "\n".join(lines)


def describe_sweep(rows: list) -> str:
    """The rows of :func:`sweep` as a table, then which configuration was fastest and which hid the most."""
    head = f"DDP, gradients {rows[0]['grad_bytes']:,} B"
    lines = [f"{head:<30}{'buckets':>8}{'step ms':>9}{'hidden':>8}{'exposed ms':>11}"]
    lines += [f"{r['config']:<30}{r['buckets']:>8}{r['step_ms']:>9.1f}{r['hidden_fraction']:>8.0%}{r['exposed_ms']:>11.1f}"
              for r in rows]
    fastest = min(rows, key=lambda r: r["step_ms"])
    hiding = max(rows, key=lambda r: r["hidden_fraction"])
    lines.append(f"this run: fastest step {fastest['config']}; most hidden {hiding['config']} "
                 f"({os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f})")
    return "\n".join(lines)


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
    parser.add_argument("--sweep", action="store_true", help="bucket sizes vs one bucket (no overlap)")
    parser.add_argument("--json", action="store_true", help="with --sweep: one JSON object per configuration")
    parser.add_argument("--where", action="store_true",
                        help="CPU per step by phase, the model alone beside both DDPs, minipar's reducer in parts")
    a = parser.parse_args(argv)
    if a.where:
        from . import bench_where
        print(bench_where.describe(bench_where.run(a.ranks, layers=a.layers, embd=a.embd, batch=a.batch,
                                                   seq=a.seq, bucket_mb=a.bucket_mb, iters=a.iters)))
        return 0
    if a.sweep:
        rows = sweep(a.ranks, layers=a.layers, embd=a.embd, batch=a.batch, seq=a.seq, iters=a.iters)
        for row in rows:
            row["load_average_1min"] = round(os.getloadavg()[0], 1)
            print(json.dumps(row) if a.json else
                  f"{row['config']:<26} {row['buckets']:3d} buckets  step {row['step_ms']:8.2f} ms  "
                  f"hidden {row['hidden_fraction']:6.1%}  exposed {row['exposed_ms']:7.2f} ms")
        return 0
    out = run(a.ranks, layers=a.layers, embd=a.embd, batch=a.batch, seq=a.seq, bucket_mb=a.bucket_mb,
              iters=a.iters, with_dp=a.with_dp, repeats=a.repeats)
    m = out["medians"]
    print(f"TinyGPT {a.layers}L/{a.embd}h, global batch {a.batch}x{a.seq} on {a.ranks} CPU ranks (gloo), "
          f"gradients {out['grad_bytes'] / 2**20:.2f} MiB, bucket {a.bucket_mb:g} MiB "
          f"({out['buckets']} buckets, {out['all_reduces']} all-reduces/step), {a.repeats} runs of {a.iters} "
          f"alternating steps")
    for name, sec in m.items():
        print(f"  {name:<28} median step {sec * 1e3:8.2f} ms")
    for torch_name, label in ((TORCH_VIEW, "like for like, the ratio"), (TORCH_DEFAULT, "extra column")):
        runs = ratios(out["runs"], torch_name)
        ratio = runs[len(runs) // 2]
        verdict = "a tie: 1.0 lies inside the runs' spread" if runs[0] <= 1 <= runs[-1] else \
            ("minipar faster in every run" if runs[-1] < 1 else "minipar slower in every run")
        print(f"  minipar / {torch_name} ({label}): per run {', '.join(f'{x:.3f}' for x in runs)}; "
              f"median run {ratio:.3f} ({verdict})")
    print(f"  ({os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; the ratio is against "
          f"{TORCH_VIEW}: gradient_as_bucket_view=True, as minipar's gradients are bucket views)")
    return 0


BENCHMARKS = {"ddp": main}

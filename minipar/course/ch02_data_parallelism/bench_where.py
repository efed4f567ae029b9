"""``python -m minipar bench ddp --where``: where minipar's DDP spends CPU that PyTorch's does not.

Three versions of one training step alternate on every rank, step by step: the model alone (no DDP, so no
gradient is averaged), minipar's DDP and PyTorch's (``gradient_as_bucket_view=True``, the like-for-like
reference of ``bench ddp``). For each step, the CPU time of this rank's main thread (``time.thread_time``: a
thread waiting for a peer or for a core costs none) in forward, backward and the optimizer step, and the CPU
of the process's other threads (gloo's, which run the all-reduces; Linux only). DDP's part of backward is its
backward's CPU less the model alone's. minipar's part is split further by
:func:`minipar.data.ddp_measure.reducer_cpu`; PyTorch's reducer is C++, seen only as a whole.

On a 2-core machine with 4 ranks every step is CPU-bound (the ranks take turns on the cores), so a step's
wall time follows the CPU all its processes burn: this table is where ``bench ddp``'s ratio comes from.
"""
from __future__ import annotations

import os
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from minipar.check import one_thread
from minipar.course.bench import model_and_batch
from minipar.loop import lm_loss

__all__ = ["PHASES", "other_threads_cpu", "where_rank", "run", "describe"]

PHASES = ("forward", "backward", "optimizer step", "other threads")
ALONE, OURS, THEIRS = "model alone", "minipar DDP", "torch DDP"


def other_threads_cpu() -> dict | None:
    """{thread id: CPU seconds} of this process's threads but the calling one (Linux: each thread's CPU clock,
    clock id ``(~tid << 3) | 6``, the kernel's ``MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)``); None elsewhere."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return None
    me, seconds = threading.get_native_id(), {}
    for tid in tids:
        if tid != me:
            try:
                seconds[tid] = time.clock_gettime((~tid << 3) | 6)
            except OSError:
                pass                              # the thread ended meanwhile
    return seconds


def _spent(before: dict | None, after: dict | None) -> float:
    if before is None or after is None:
        return float("nan")
    return sum(s - before.get(tid, 0.0) for tid, s in after.items())


def where_rank(rank, world_size, layers=4, embd=128, batch=16, seq=64, bucket_mb=1.0, iters=40, warmup=3):
    """On each rank: {version: {phase: [CPU seconds per step]}} and {part: [minipar's reducer CPU per step]}."""
    from minipar.data import ddp
    from minipar.data.ddp_measure import REDUCER_PARTS, reducer_cpu
    from minipar.loop import shard_batch

    make, batch_xy = model_and_batch(layers, embd, batch, seq)
    xs, ys = shard_batch(batch_xy, rank, world_size)
    alone, ours_model, theirs_model = make(), make(), make()
    ours = ddp.DistributedDataParallel(ours_model, bucket_bytes=int(bucket_mb * 2**20))
    parts = reducer_cpu(ours)
    theirs = nn.parallel.DistributedDataParallel(theirs_model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    versions = {ALONE: (alone, alone), OURS: (ours, ours_model), THEIRS: (theirs, theirs_model)}
    opts = {name: torch.optim.SGD(model.parameters(), lr=0.01) for name, (_, model) in versions.items()}
    phases = {name: {p: [] for p in PHASES} for name in versions}
    part_steps = {p: [] for p in REDUCER_PARTS}
    names = list(versions)
    with one_thread():
        for i in range(warmup + iters):
            for name in (names if i % 2 == 0 else names[::-1]):
                wrapped, _ = versions[name]
                dist.barrier()
                parts_before, others = dict(parts), other_threads_cpu()
                t0 = time.thread_time()
                opts[name].zero_grad(set_to_none=True)
                loss = lm_loss(wrapped(xs), ys)
                t1 = time.thread_time()
                loss.backward()
                t2 = time.thread_time()
                opts[name].step()
                t3 = time.thread_time()
                dist.barrier()                        # the step's collectives are over on every rank
                if i < warmup:
                    continue
                for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, _spent(others, other_threads_cpu()))):
                    phases[name][phase].append(seconds)
                if name == OURS:
                    for p in REDUCER_PARTS:
                        part_steps[p].append(parts[p] - parts_before[p])
    return {"phases": phases, "parts": part_steps}


def run(world_size=4, quiet=True, **kwargs) -> dict:
    """Launch :func:`where_rank`; per version and phase, and per part of minipar's reducer: the median over the
    steps, averaged over the ranks, in milliseconds."""
    from minipar.launcher import launch
    per_rank = launch(where_rank, world_size, quiet=quiet, timeout=600, **kwargs)

    def ms(per_rank_steps):
        return 1e3 * statistics.fmean(statistics.median(steps) for steps in per_rank_steps)

    table = {name: {p: ms(r["phases"][name][p] for r in per_rank) for p in PHASES} for name in (ALONE, OURS, THEIRS)}
    parts = {p: ms(r["parts"][p] for r in per_rank) for p in per_rank[0]["parts"]}
    return {"table": table, "parts": parts, "ranks": world_size}


def describe(result: dict) -> str:
    """The table of :func:`run`: CPU per step by phase for the three versions, DDP's part of backward, the
    total, and minipar's reducer split into its parts."""
    t, names = result["table"], (ALONE, OURS, THEIRS)
    lines = [f"CPU per step, ms, per rank (median over steps, mean over {result['ranks']} ranks)",
             f"{'':<34}" + "".join(f"{n:>14}" for n in names)]
    for phase in PHASES:
        lines.append(f"  {phase:<32}" + "".join(f"{t[n][phase]:14.2f}" for n in names))
    extra = {n: t[n]["backward"] - t[ALONE]["backward"] for n in (OURS, THEIRS)}
    lines.append(f"  {'DDP in backward (vs model alone)':<32}{'':>14}" + "".join(f"{extra[n]:14.2f}" for n in (OURS, THEIRS)))
    total = {n: sum(t[n].values()) for n in names}
    lines.append(f"  {'all threads, whole step':<32}" + "".join(f"{total[n]:14.2f}" for n in names))
    seen = sum(result["parts"].values())
    lines.append("minipar's reducer, main thread: " + ", ".join(f"{p} {v:.2f}" for p, v in result["parts"].items())
                 + f"; autograd calling its Python hooks and the rest {extra[OURS] - seen:.2f} ms")
    lines.append(f"minipar / torch DDP, all threads: {total[OURS] / total[THEIRS]:.3f} "
                 f"({total[OURS] - total[THEIRS]:+.2f} ms per step)")
    return "\n".join(lines)

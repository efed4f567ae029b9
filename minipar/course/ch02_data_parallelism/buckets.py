"""Chapter 02's bucket-size U-curve: one compute trace, replayed across bucket sizes (a model).

DDP is run once here with one parameter per bucket (``bucket_bytes=1``: every gradient's all-reduce is
launched the moment autograd produces it), every rank traced with its operators counted (``ops=True``:
:mod:`minipar.observe.opcount`). That trace holds the backward cut at every gradient. :func:`rebucket` turns
it into the trace of the same step at any bucket capacity C, without running it again: consecutive
all-reduces are merged as :func:`minipar.data.buckets.assign_buckets` packs parameters (a bucket closes as
soon as it holds C bytes or more), each merged call issued where its last gradient was ready and waited
for where that one was. :func:`sweep` replays each on a carded cluster (:func:`minipar.machine.replay.replay`:
the operators priced on the device, each all-reduce its α-β time): the step against C.

The two arms: small buckets pay an all-reduce's latency 2(N−1)·α per bucket, serialized on the links;
one bucket cannot start before the last gradient and its whole transfer is exposed. Where they meet
depends on the link's α and β and on how long the backward lasts — so the cluster is a choice:
:data:`U_CLUSTER`, four A100s one per node (every all-reduce on InfiniBand HDR, 10 µs a step), where this
tiny model's launch-bound backward (its kernels × the card's floor) lasts about as long as a few
all-reduces' latencies.
"""
from __future__ import annotations

import dataclasses

import torch

from minipar.machine.cluster import IB_HDR, NVLINK3, gpu_cluster
from minipar.machine.device import A100_SXM_80GB
from minipar.machine.replay import replay
from minipar.machine.trace import Comm, RankTrace, Trace, Wait

__all__ = ["U_CLUSTER", "BUCKET_SIZES", "counted_per_parameter", "rebucket", "sweep", "draw_sweep"]

U_CLUSTER = gpu_cluster(A100_SXM_80GB, 4, NVLINK3, IB_HDR, devices_per_node=1)
BUCKET_SIZES = tuple(4 ** k for k in range(3, 10))     # 64 B … 256 KiB; the sweep adds one bucket of everything


def _counted_rank(rank, world_size, layers, embd, batch, seq, steps):
    from minipar.course.bench import model_and_batch
    from minipar.data import ddp
    from minipar.loop import lm_loss, shard_batch
    from minipar.observe.measure import timed_steps

    torch.set_num_threads(1)
    make, (x, y) = model_and_batch(layers, embd, batch, seq)
    xs, ys = shard_batch((x, y), rank, world_size)
    model = make()
    wrapped = ddp.DistributedDataParallel(model, bucket_bytes=1)      # one parameter per bucket
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        lm_loss(wrapped(xs), ys).backward()
        opt.step()
    step()                                                             # warm-up, not traced
    with timed_steps(rank, ops=True) as run:
        for _ in range(steps):
            step()
            run.tick()
    return run, sum(p.numel() * p.element_size() for p in model.parameters())


def counted_per_parameter(world_size=4, layers=2, embd=64, batch=16, seq=32, steps=2) -> tuple:
    """(Trace with operators, gradient bytes) of DDP with one parameter per bucket on ``world_size`` ranks."""
    from minipar.launcher import launch
    from minipar.observe.measure import gather_steps
    ranks = launch(_counted_rank, world_size, layers, embd, batch, seq, steps, quiet=True, timeout=300)
    return gather_steps([r for r, _ in ranks], {"buckets": "one per parameter"}).trace, ranks[0][1]


def _closes_step(events: list, i: int) -> bool:
    """Whether the async all-reduce at ``i`` is the last launched before the program waits (its step's last)."""
    for e in events[i + 1:]:
        if isinstance(e, Wait):
            return True
        if isinstance(e, Comm) and e.async_:
            return False
    return True


def _rebucket_rank(events: list, bucket_bytes: int) -> list:
    closes, run, size = {}, [], 0            # index of the call that closes a bucket -> its bytes
    for i, e in enumerate(events):
        if not (isinstance(e, Comm) and e.async_ and e.op == "all_reduce"):
            continue
        run.append(i)
        size += e.bytes
        if size >= bucket_bytes or _closes_step(events, i):
            closes[i] = (size, events[run[0]].waited_at)     # waited for where its first member was
            run, size = [], 0
    merged = {i for i, e in enumerate(events) if isinstance(e, Comm) and e.async_ and e.op == "all_reduce"
              and i not in closes}
    kept_waits = {w for _, w in closes.values() if w is not None}
    dropped = merged | {e.waited_at for e in events if isinstance(e, Comm) and e.async_ and e.op == "all_reduce"
                        and e.waited_at is not None and e.waited_at not in kept_waits}
    keep = [i for i in range(len(events)) if i not in dropped]
    owner = {wait: i for i, (_, wait) in closes.items() if wait is not None}     # a kept Wait -> its merged call
    new_index = {old: new for new, old in enumerate(keep)}
    out = []
    for old in keep:
        e = events[old]
        if old in closes:
            size, wait = closes[old]
            e = dataclasses.replace(e, bytes=size, waited_at=None if wait is None else new_index[wait])
        elif isinstance(e, Wait):
            e = Wait(new_index[owner[old]])
        out.append(e)
    return out


def rebucket(trace: Trace, bucket_bytes: int) -> Trace:
    """``trace`` (DDP with one parameter per bucket) as DDP with buckets of ``bucket_bytes``: consecutive async
    all-reduces of a step merged while they hold fewer than ``bucket_bytes`` (the last of a step closes its
    bucket whatever its size), each merged call where its last member was (its last gradient), and its Wait where
    its first member's was (the first point the program needs the bucket back)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return Trace([RankTrace(r.rank, _rebucket_rank(r.events, bucket_bytes)) for r in trace.ranks],
                 dict(trace.meta, bucket_bytes=bucket_bytes))


def sweep(trace: Trace, bucket_sizes, cluster=U_CLUSTER) -> list:
    """One row per bucket capacity: {"bucket_bytes", "buckets" (all-reduces a step), "step" (s, the slowest
    rank's), "exposed" (s, mean over ranks), "compute" (s, mean over ranks)} of :func:`rebucket` replayed on
    ``cluster`` (a model), the last step."""
    from minipar.course.replays import exposed_per_step, last_step
    rows = []
    for size in bucket_sizes:
        bucketed = rebucket(trace, size)
        played = replay(bucketed, cluster)
        step = last_step(played)
        ranks = range(len(step.timelines))
        events = bucketed.ranks[0].events
        marks = [i for i, e in enumerate(events) if getattr(e, "label", None) == "step"]
        calls = sum(1 for e in events[marks[-2]:marks[-1]] if isinstance(e, Comm) and e.op == "all_reduce")
        rows.append({"bucket_bytes": size, "buckets": calls, "step": played.step_between("step"),
                     "exposed": exposed_per_step(played), "compute": sum(step.compute(r) for r in ranks) / len(ranks)})
    return rows


def draw_sweep(rows, ax=None, cluster_name: str = "4 A100s, one per node, InfiniBand HDR"):
    """The U: :func:`sweep`'s step (the slowest rank's) and exposed communication against the bucket
    capacity, each point labelled with its all-reduces a step; a model, titled so."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    xs = [r["bucket_bytes"] for r in rows]
    ax.plot(xs, [r["step"] * 1e6 for r in rows], "o-", label="step (slowest rank)")
    ax.plot(xs, [r["compute"] * 1e6 for r in rows], "k:", label="compute (the same trace at every size)")
    ax.plot(xs, [r["exposed"] * 1e6 for r in rows], "s--", color="#C44E52", label="exposed communication (mean over ranks)")
    for r in rows:
        ax.annotate(str(r["buckets"]), (r["bucket_bytes"], r["step"] * 1e6), textcoords="offset points",
                    xytext=(0, 5), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bucket capacity (bytes); numbers: all-reduces a step")
    ax.set_ylabel("µs")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Model: one DDP trace re-bucketed and replayed on {cluster_name}", fontsize=9)
    ax.legend(fontsize=7)
    return ax.figure

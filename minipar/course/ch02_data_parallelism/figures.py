"""Chapter 02 pictures, from real runs on 4 ranks.

* ``02_ddp_timeline.png``: one DDP training step per rank, on a time axis shared by the ranks: forward,
  backward up to its last gradient (a tick where each gradient became ready), the wait after it (grey: backward
  has nothing left to compute and ``loss.backward()`` waits for the last buckets), and each bucket's all-reduce
  from its launch to its completion, green before the rank's last gradient (hidden) and red after (exposed) (observed from outside DDP by :func:`minipar.data.ddp_measure.watch_buckets`, through the
  reducer's seams and the work's completion callback).
  Buckets launched before backward ends are communication overlapped with compute.
* ``02_bucket_u_curve.png``: a model — one DDP trace (one parameter per bucket, operators counted) re-bucketed
  at each capacity and replayed on four A100s across InfiniBand (:mod:`.buckets`): the step against the bucket.
"""
from __future__ import annotations

import time

__all__ = ["ddp_timeline", "draw_timeline", "overlap_fraction", "FIGURES"]


def _timeline_rank(rank, world_size, layers, embd, batch, seq, bucket_bytes, warmup):
    import torch.distributed as dist
    from minipar.loop import lm_loss
    from minipar.course.bench import model_and_batch
    from minipar.data import ddp
    from minipar.data.ddp_measure import watch_buckets
    from minipar.loop import shard_batch

    make, batch_ = model_and_batch(layers, embd, batch, seq)
    x, y = shard_batch(batch_, rank, world_size)
    model = ddp.DistributedDataParallel(make(), bucket_bytes=bucket_bytes)
    events = watch_buckets(model)
    for i in range(warmup + 1):
        events.clear()
        dist.barrier()
        origin = time.perf_counter()  # ranks leave the barrier within microseconds of each other
        t0 = time.perf_counter()
        logits = model(x)
        loss = lm_loss(logits, y)
        t1 = time.perf_counter()
        loss.backward()  # returns once every bucket is reduced and written back
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
    time.sleep(0.05)  # let the last completion callbacks land
    # backward computes until its last gradient; from there until loss.backward() returns it only waits for
    # the last buckets' all-reduces (and for the slowest rank to join them): idle, not compute
    last_grad = max(a for k, _, a, _ in events if k == "grad" and a >= t1)
    spans = [("forward", "forward", t0, t1), ("backward", "backward", t1, last_grad), ("wait", "wait", last_grad, t2)]
    # (a completion callback of the previous step may land late: keep only this step's events)
    return [(k, label, a - origin, b - origin) for k, label, a, b in spans + list(events) if a >= origin]


def ddp_timeline(world_size=4, layers=4, embd=128, batch=16, seq=64, bucket_bytes=256 * 1024, warmup=2):
    """Per rank: [(kind, label, start s, end s)] of one DDP step (kinds forward/backward/grad/comm)."""
    from minipar.launcher import launch
    return launch(_timeline_rank, world_size, layers, embd, batch, seq, bucket_bytes, warmup, quiet=True)


def overlap_fraction(events) -> float:
    """Share of the communication time (launch to completion, summed over buckets) spent while this rank
    was still computing gradients (before its last gradient was ready): communication hidden by compute."""
    compute_end = max(a for k, _, a, _ in events if k == "grad")
    comm = [(a, b) for k, _, a, b in events if k == "comm"]
    total = sum(b - a for a, b in comm)
    hidden = sum(max(0.0, min(b, compute_end) - a) for a, b in comm)
    return hidden / total if total else 0.0


def draw_timeline(per_rank, ax=None):
    """The course's replay legend (:data:`minipar.pipeline.gantt.KIND_COLOURS`): compute blue (forward paler),
    idle grey, an all-reduce green while the rank still computes gradients (hidden) and red after (exposed)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from minipar.pipeline.gantt import KIND_COLOURS
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 + 0.8 * len(per_rank)))
    bars = {"forward": (KIND_COLOURS["compute"], 0.45), "backward": (KIND_COLOURS["compute"], 0.9),
            "wait": (KIND_COLOURS["idle"], 1.0)}
    hidden, exposed = KIND_COLOURS["comm hidden"], KIND_COLOURS["comm exposed"]
    for rank, events in enumerate(per_rank):
        y = len(per_rank) - 1 - rank
        last_grad = max(a for k, _, a, _ in events if k == "grad")
        for kind, label, a, b in events:
            if kind in bars:
                ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (y + 0.45, 0.4), color=bars[kind][0], alpha=bars[kind][1])
            elif kind == "grad":
                ax.plot([a * 1e3] * 2, [y + 0.45, y + 0.85], color="black", lw=0.5)
            elif kind == "comm":   # split at the last gradient: before it hidden under backward, after it exposed
                lane = (y + 0.05 + 0.3 * (int(label.split()[-1]) % 2) / 2, 0.2)
                cut = min(max(a, last_grad), b)
                ax.broken_barh([(a * 1e3, (cut - a) * 1e3)], lane, color=hidden)
                ax.broken_barh([(cut * 1e3, (b - cut) * 1e3)], lane, color=exposed)
                ax.plot([a * 1e3] * 2, [lane[0], lane[0] + lane[1]], color="black", lw=1)   # this bucket left
        ax.text(-0.5, y + 0.5, f"rank {rank}", ha="right", va="center", fontsize=8)
    ax.set_yticks([])
    ax.set_xlabel("ms since the step began")
    ax.legend(handles=[Patch(color=bars["forward"][0], alpha=0.45, label="forward"),
                       Patch(color=bars["backward"][0], label="backward to its last gradient (ticks: a gradient ready)"),
                       Patch(color=bars["wait"][0], label="idle: waiting for the last buckets"),
                       Patch(color=hidden, label="all-reduce during backward (a tick: a bucket left)"),
                       Patch(color=exposed, label="all-reduce after the last gradient (exposed)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, fontsize=8, frameon=False)
    ax.set_title("DDP, measured here, unpaced: buckets start during backward\n"
                 "(on shared cores the red says who held the cores; §5 measures the saving on a quiet machine)", fontsize=10)
    return ax.figure


def _make_timeline(path):
    import matplotlib.pyplot as plt
    per_rank = ddp_timeline()
    fig = draw_timeline(per_rank)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _make_u_curve(path):
    import matplotlib.pyplot as plt
    from .buckets import BUCKET_SIZES, counted_per_parameter, draw_sweep, sweep
    trace, grad_bytes = counted_per_parameter()
    fig = draw_sweep(sweep(trace, BUCKET_SIZES + (grad_bytes,)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


FIGURES = {"02_ddp_timeline.png": _make_timeline, "02_bucket_u_curve.png": _make_u_curve}

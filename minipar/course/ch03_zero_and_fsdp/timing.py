"""Chapter 03's time: ZeRO-3 with and without prefetch, measured here and replayed on a named cluster.

One launch trains the tiny GPT with ZeRO-3 (one unit per block, :func:`minipar.data.zero.parallel_train`)
twice, ``prefetch=True`` and ``False``, under :func:`minipar.trace.tracing`, each optimizer step marked.
Per run: the wall seconds between optimizer steps (**measured on this machine**) and the trace, which
:func:`minipar.course.ch02_data_parallelism.timing.replays` plays on declared clusters (**model**). With
prefetch the next unit's all-gather is issued before the current unit computes and waited for when it is
needed; without, each gather is issued and waited for right where the unit starts.
"""
from __future__ import annotations

import time

import torch

__all__ = ["traced_rank", "measure"]

STEP_RECIPE = dict(batch_size=16, seq_len=32, n_layer=4, n_embd=64)   # 4 blocks: 4 units (+ the root)


def _marked(factory, stamps):
    """The optimizer factory, with every ``step()`` time-stamped and marked "step" in the trace."""
    from minipar import trace

    def build(params):
        opt = factory(params)
        step = opt.step

        def marked_step(*args, **kwargs):
            out = step(*args, **kwargs)
            stamps.append(time.perf_counter())
            trace.mark("step")
            return out
        opt.step = marked_step
        return opt
    return build


def traced_rank(rank, world_size, steps):
    """{prefetch: (fastest wall gap between optimizer steps, RankTrace)}, and the step's FLOPs per rank."""
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode
    from minipar import trace
    from minipar.check import gpt_recipe
    from minipar.data import zero
    from minipar.loop import shard_batch
    torch.set_num_threads(1)
    out = {}
    for prefetch in (True, False):
        recipe = gpt_recipe(steps=steps + 1, optimizer="sgd", **STEP_RECIPE)   # step 1 records the unit order
        stamps = []
        recipe.optimizer = _marked(recipe.optimizer, stamps)
        dist.barrier()
        with trace.tracing(rank) as rank_trace:
            zero.parallel_train(rank, world_size, recipe, stage=3, prefetch=prefetch)
        gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
        out[prefetch] = (min(gaps), rank_trace)
    recipe = gpt_recipe(steps=1, **STEP_RECIPE)
    x, y = shard_batch(recipe.batches[0], rank, world_size)
    with FlopCounterMode(display=False) as counter:
        recipe.loss(recipe.model(), x, y).backward()
    from minipar.course.ch02_data_parallelism.timing import link_times
    return out, counter.get_total_flops(), link_times()


def measure(world_size: int = 4, steps: int = 2) -> dict:
    """{"traces": {"prefetch" | "no prefetch": Trace}, "measured": {…: s}, "flops_here", "flops_per_step",
    "steps", "alpha", "beta" (gloo's all-reduce here, fitted), "param_bytes" (gathered per pass)} — the shape :func:`minipar.course.ch02_data_parallelism.timing.replays` reads. The first
    optimizer step (the unit order being recorded, no prefetch yet) stays in the trace, so a replay's step is
    read between later marks (``step_between``)."""
    from minipar.launcher import launch
    from minipar.trace import Trace
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (a step is the gap between two optimizer steps), got {steps}")
    ranks = launch(traced_rank, world_size, steps, quiet=True, timeout=300)
    names = {True: "prefetch", False: "no prefetch"}
    traces = {names[p]: Trace([r[0][p][1] for r in ranks], {"strategy": f"ZeRO-3, {names[p]}"}) for p in names}
    from minipar.course.ch02_data_parallelism.timing import fit_link
    flops = ranks[0][1]
    alpha, beta = fit_link(ranks[0][2], world_size)
    cpu_per_step = max(t.compute_cpu_seconds for t in traces["prefetch"].ranks) / (steps + 1)
    return {"traces": traces, "measured": {names[p]: max(r[0][p][0] for r in ranks) for p in names},
            "flops_per_step": flops, "flops_here": flops / cpu_per_step, "steps": steps + 1,
            "world_size": world_size, "alpha": alpha, "beta": beta,
            "param_bytes": sum(c.bytes for c in traces["prefetch"].ranks[0].comms() if c.op == "all_gather")
            / (2 * (steps + 1))}

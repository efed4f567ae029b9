"""``python -m minipar bench replay [--json]``: measure a strategy here, then play its trace on declared machines.

Per strategy, from one run: the step measured here (wall clock, between optimizer steps, the slowest rank),
the same run's trace (:mod:`minipar.trace`) replayed on this machine (compute: each segment's thread CPU
seconds; links: α, β fitted to gloo's all-reduce here, :func:`calibrate`) and on a DGX-A100 node (compute
scaled by this machine's calibrated FLOP/s over the A100's peak × efficiency), beside the planner's
prediction (:func:`minipar.plan.estimate`) on both. The ratios measured / replayed and measured / predicted
say how far each model is from this machine; the DGX column is a model only (labelled so).
"""
from __future__ import annotations

import time

from .bench import STEP_BATCH, STEP_MODEL, STEP_SEQ, _cfg_kwargs, _train, calibrate, calibrated_cluster, \
    step_layouts

__all__ = ["REPLAY_STRATEGIES", "replay_rows", "main"]

REPLAY_STRATEGIES = ("DDP", "1F1B")


def _marked(factory, stamps):
    """The optimizer factory, with every ``step()`` time-stamped and marked in the trace."""
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


def _traced_train(rank, world_size, name, steps):
    """(measured seconds per step, this rank's trace) of strategy ``name`` trained for ``steps`` steps."""
    import torch.distributed as dist
    from minipar import trace
    from minipar.check import gpt_recipe
    recipe = gpt_recipe(steps=steps, batch_size=STEP_BATCH, seq_len=STEP_SEQ, **_cfg_kwargs())
    stamps = []
    recipe.optimizer = _marked(recipe.optimizer, stamps)
    dist.barrier()
    with trace.tracing(rank) as rank_trace:
        _train(rank, world_size, name, recipe)
    return min(b - a for a, b in zip(stamps, stamps[1:])), rank_trace


def replay_rows(cal: dict, names=REPLAY_STRATEGIES, steps: int = 4) -> list:
    """One dict per strategy: measured here, replayed here / on a DGX-A100 node, planner here / on DGX-A100
    (seconds per step), and the replay's exposed communication and idle time of the busiest rank as shares of
    the whole replayed run (set-up included)."""
    from minipar.launcher import launch
    from minipar.plan import estimate
    from minipar.plan.cluster import dgx_a100
    from minipar.replay import replay
    from minipar.trace import Trace
    n = cal["ranks"]
    here, dgx = calibrated_cluster(cal, n), dgx_a100(1)
    layouts = step_layouts(n)
    out = []
    for name in names:
        ranks = launch(_traced_train, n, name, steps, quiet=True)
        trace = Trace([t for _, t in ranks], {"flops_per_second": cal["flops"], "strategy": name})
        played = {"here": replay(trace, here, compute_scale=1.0), "dgx_a100": replay(trace, dgx)}
        kw = dict(precision="fp32", dropout=False, bucket_bytes=25 * 2 ** 20)
        row = {"name": name, "ranks": n, "measured": max(s for s, _ in ranks),
               "planner_here": estimate(STEP_MODEL, here, layouts[name], **kw).step_seconds,
               "planner_dgx_a100": estimate(STEP_MODEL, dgx, layouts[name], **kw).step_seconds}
        for where, result in played.items():
            busiest = max(range(n), key=result.compute)
            row[f"replay_{where}"] = result.step_between("step")
            row[f"exposed_share_{where}"] = result.exposed(busiest) / result.step_seconds
            row[f"idle_share_{where}"] = result.idle(busiest) / result.step_seconds
        out.append(row)
    return out


def main(argv=None) -> int:
    import argparse
    import json
    parser = argparse.ArgumentParser(prog="python -m minipar bench replay")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--steps", type=int, default=4, help="training steps per strategy (default 4)")
    args = parser.parse_args(argv)
    if args.steps < 2:                             # a step is the gap between two optimizer steps
        parser.error(f"--steps must be at least 2, got {args.steps}")
    cal = calibrate()
    rows = replay_rows(cal, steps=args.steps)
    if args.json:
        print(json.dumps({"calibration": {k: v for k, v in cal.items() if k != "samples"}, "rows": rows}, indent=1))
        return 0
    print(f"{cal['ranks']} ranks; a rank here {cal['flops'] / 1e9:.2f} GFLOP/s; ms per step (ratio measured/x)")
    for r in rows:
        m = r["measured"]
        print(f"{r['name']:6} measured {m * 1e3:7.1f} | replay here {r['replay_here'] * 1e3:7.1f} "
              f"x{m / r['replay_here']:.2f} | planner here {r['planner_here'] * 1e3:7.1f} x{m / r['planner_here']:.2f}"
              f" | model: replay DGX-A100 {r['replay_dgx_a100'] * 1e3:.3f}, planner DGX-A100 "
              f"{r['planner_dgx_a100'] * 1e3:.3f} | replay here: comm exposed {r['exposed_share_here']:.0%}, "
              f"idle {r['idle_share_here']:.0%} of the run")
    return 0


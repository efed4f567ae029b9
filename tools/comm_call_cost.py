"""What one async all-reduce costs through minipar.comm, against torch.distributed and the ProcessGroup.

    PYTHONPATH=$PWD python tools/comm_call_cost.py            # 2 gloo ranks, then minipar's own cost

Two measures (issue 51, DDP at PyTorch's speed):

* ``ranks``: 2 gloo ranks launched by minipar (so each rank's flight recorder is on, as in every run), an
  all-reduce of 64 floats launched and waited ``iters`` times per block, the three paths in turn per block;
  per path the median over blocks of the wall µs per call and of the main thread's CPU µs per call
  (``time.thread_time``: the wall time is mostly gloo's latency and the other rank's, on a shared machine).
* ``own``: minipar's own cost, the collective replaced by a finished work (world size 1, in this process):
  µs per call with no hook, and with a flight recorder as the only hook (a rank's usual case). Minimum over
  repeats. Not a test: speed is measured here, never in timed tests.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import timeit

import torch
import torch.distributed as dist


def _rank(rank, world_size, iters=2000, blocks=7):
    from minipar import comm
    t, pg = torch.ones(64), dist.group.WORLD
    paths = {"minipar.comm": lambda: comm.all_reduce(t, async_op=True).wait(),
             "torch.distributed": lambda: dist.all_reduce(t, async_op=True).wait(),
             "ProcessGroup": lambda: pg.allreduce([t], dist.AllreduceOptions()).wait()}
    for run in paths.values():
        for _ in range(200):
            run()
    wall, cpu = {k: [] for k in paths}, {k: [] for k in paths}
    for _ in range(blocks):
        for name, run in paths.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(iters):
                run()
            cpu[name].append((time.thread_time() - c0) / iters * 1e6)
            wall[name].append((time.perf_counter() - t0) / iters * 1e6)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in paths}


class _Finished:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self) -> bool:
        return True


def own_cost(number: int = 20000, repeat: int = 7) -> dict:
    """µs per ``comm.all_reduce(t, async_op=True).wait()`` with the collective stubbed out: {hooks: µs}."""
    from minipar import comm, flight, hooks
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    real, finished, t = dist.all_reduce, _Finished(), torch.ones(64)
    dist.all_reduce = lambda *args, **kwargs: finished          # minipar.comm looks it up on call
    try:
        def per_call():
            return min(timeit.repeat(lambda: comm.all_reduce(t, async_op=True).wait(), number=number,
                                     repeat=repeat)) / number * 1e6
        with hooks.only():
            bare = per_call()
        with hooks.only(flight.FlightRecorder(tempfile.mktemp())):
            recorded = per_call()
    finally:
        dist.all_reduce = real
        dist.destroy_process_group()
    return {"no hook": bare, "flight recorder": recorded}


def main() -> int:
    from minipar.launcher import launch
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPU cores")
    for name, (wall, cpu) in launch(_rank, 2, quiet=True, timeout=300)[0].items():
        print(f"  2 ranks, {name:<18} {wall:7.1f} µs wall  {cpu:6.1f} µs main-thread CPU per call")
    for hooks, us in own_cost().items():
        print(f"  minipar's own cost, {hooks:<16} {us:5.2f} µs per call (collective stubbed out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

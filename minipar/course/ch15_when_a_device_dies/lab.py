"""The runs chapter 15 shows: an asynchronous save's trace and a kill during its write, a bit flip caught on
data-parallel replicas and what the check costs, and (when :mod:`minipar.fault` exists) a run that loses a
replica. Small: the tiny GPT, two to four ranks, a few steps."""
from __future__ import annotations

import functools
import importlib.util
import os
import statistics
import time

import torch

from minipar import comm, launch
from minipar.check import gpt_recipe
from minipar.debug.sdc import CheckedTrainer, Flip
from minipar.hybrid import checkpoint
from minipar.hybrid.async_checkpoint import AsyncCheckpointer, save_timeline
from minipar.hybrid.parallel3d import Trainer3D

__all__ = ["LAYOUT", "recipe", "async_trace", "kill_during_write", "bit_flip", "check_cost", "draw_save_trace",
           "fault_tolerant_run"]

LAYOUT = dict(dp=1, pp=2, tp=1, micro_batches=2)         # two ranks, each writes its stage's file
SLOW_WRITE = 0.3                                         # seconds the writer thread waits: a slow disk


def recipe(steps=4):
    r = gpt_recipe(steps=steps, batch_size=4, seq_len=8, n_layer=2)
    r.dtype = torch.float64
    return r


def _slow(step, *, at):
    if step == at:
        time.sleep(SLOW_WRITE)


def _async_rank(rank, world_size, recipe, directory, slow_at, crash_rank=None):
    t = Trainer3D(rank, world_size, recipe, **LAYOUT)
    saver = AsyncCheckpointer(t, directory, before_write=functools.partial(_slow, at=slow_at))
    for i in range(recipe.steps):
        saver.step_started(i)
        t.step(*recipe.batches[i], i)
        saver.crash_rank = crash_rank if i + 1 == slow_at else None
        saver.save(i + 1)
    saver.finish()
    return saver.events


def async_trace(directory: str, steps: int = 4, slow_at: int = 2) -> list:
    """Rank 0's events of a run that saves asynchronously after every step, the save of step ``slow_at``
    written slowly."""
    return launch(_async_rank, 2, recipe(steps), directory, slow_at, quiet=True)[0]


def _sync_rank(rank, world_size, recipe, start_from):
    t = Trainer3D(rank, world_size, recipe, **LAYOUT)
    start = checkpoint.load(t, start_from) if start_from else 0
    for i in range(start, recipe.steps):
        t.step(*recipe.batches[i], i)
    return start, t.full_params()


def kill_during_write(directory: str) -> dict:
    """Rank 1 killed (SIGKILL) while it writes step 2's checkpoint in the background and step 3 trains; then
    the restart from ``latest`` and a run that never stopped. {"error", "latest", "partial", "start",
    "max_diff": the largest |Δ| between the resumed run's final parameters and the uninterrupted run's}."""
    from minipar.launcher import RankError
    try:
        launch(_async_rank, 2, recipe(), directory, 2, crash_rank=1, quiet=True, timeout=5)
        error = None
    except RankError as exc:
        error = str(exc).splitlines()[0]
    resumed = launch(_sync_rank, 2, recipe(), directory, quiet=True)
    straight = launch(_sync_rank, 2, recipe(), None, quiet=True)
    diff = max(float((a[n] - b[n]).abs().max()) for (_, a), (_, b) in zip(resumed, straight) for n in a)
    return {"error": error, "latest": os.path.basename(checkpoint.latest(directory)),
            "partial": sorted(n for n in os.listdir(directory) if n.endswith(".partial")),
            "start": resumed[0][0], "max_diff": diff}


def _flip_rank(rank, world_size, recipe, layout, flip):
    checked = CheckedTrainer(Trainer3D(rank, world_size, recipe, **layout), flip=flip)
    plain = Trainer3D(rank, world_size, recipe, **layout)
    for i in range(recipe.steps):
        checked.step(*recipe.batches[i], i)
        plain.step(*recipe.batches[i], i)
    a, b = checked.trainer.full_params(), plain.full_params()
    return checked.findings, max(float((a[n] - b[n]).abs().max()) for n in a)


def bit_flip(layout: dict, world_size: int, flip: Flip, steps: int = 3) -> list:
    """Every rank's (findings, max |Δ| to the run that never flipped) for a checked run with ``flip``."""
    return launch(_flip_rank, world_size, recipe(steps), layout, flip, quiet=True)


def _cost_rank(rank, world_size, recipe, steps):
    seconds, sent = {False: [], True: []}, {False: 0.0, True: 0.0}
    for n, checked in enumerate((False, True) * 3):       # alternate: the machine's drift falls on both
        t = Trainer3D(rank, world_size, recipe, dp=world_size, micro_batches=1)
        runner = CheckedTrainer(t) if checked else t
        runner.step(*recipe.batches[0], 0)                # warm-up, not timed
        with comm.recording() as log:
            for i in range(1, steps):
                t0 = time.perf_counter()
                runner.step(*recipe.batches[i], i)
                if n >= 2:                               # the first pair warms the process up
                    seconds[checked].append(time.perf_counter() - t0)
        sent[checked] = log.bytes_sent / (steps - 1)
    grad_bytes = sum(p.numel() * p.element_size() for p in t.dense_params)
    return ({k: statistics.median(v) for k, v in seconds.items()}, sent[True] - sent[False], grad_bytes,
            len(t.dense_params))


def check_cost(steps: int = 8) -> dict:
    """Seconds per step with and without the check (medians over alternating runs, dp 2), the check's bytes
    sent per step by one rank (the checked run's minus the plain run's), the gradient's bytes and tensors."""
    seconds, check_bytes, grad_bytes, tensors = launch(_cost_rank, 2, recipe(steps), steps, quiet=True)[0]
    return {"plain_s": seconds[False], "checked_s": seconds[True], "check_bytes": check_bytes,
            "grad_bytes": grad_bytes, "tensors": tensors}


def draw_save_trace(events: list, ax=None):
    """The trace: training steps on one row, each save's snapshot and background write below."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(9, 2.4))[1]
    t0 = min(t for *_, t in events)
    starts = sorted((s, t - t0) for what, s, t in events if what == "step_start")
    ends = {s: t - t0 for what, s, t in events if what == "snapshot_start"}
    for s, start in starts:
        ax.barh(2, ends.get(s + 1, start) - start, left=start, color="tab:blue", edgecolor="white")
        ax.text(start, 2.3, f"step {s + 1}", fontsize=8)
    for row in save_timeline(events):
        (a, b), (c, d) = row["snapshot"], row["write"]
        ax.barh(1, b - a, left=a, color="tab:red")
        ax.barh(0, (d or c) - c, left=c, color="tab:orange", alpha=0.7)
        ax.text(c, -0.45, f"write {row['step']}", fontsize=8)
    ax.set_yticks([0, 1, 2], ["write (thread)", "snapshot", "training"])
    ax.set_xlabel("seconds")
    return ax


def fault_tolerant_run() -> dict | None:
    """A run of replica groups that loses one mid-training and goes on, beside an uninterrupted run; None with a
    one-line message while :mod:`minipar.fault` is not part of this minipar."""
    if importlib.util.find_spec("minipar.fault") is None:
        print("minipar.fault is not in this version of minipar: the fault-tolerant run is not shown yet.")
        return None
    raise NotImplementedError("the fault-tolerant run is wired in with minipar.fault")

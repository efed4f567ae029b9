"""The runs chapter 15 shows: an asynchronous save's trace and a kill during its write, a bit flip caught on
data-parallel replicas and what the check costs, and a run of replica groups that loses a replica and goes on
(:mod:`minipar.fault`), drawn as a timeline. Small: the tiny GPT, two to four ranks, a few steps."""
from __future__ import annotations

import functools
import os
import statistics
import time

import torch

from minipar import comm, launch
from minipar.check import gpt_recipe
from minipar.debug.sdc import CheckedTrainer, Flip
from minipar.fault import replicas
from minipar.fault.quorum import FaultPlan
from minipar.hybrid import checkpoint
from minipar.hybrid.async_checkpoint import AsyncCheckpointer, save_timeline
from minipar.hybrid.parallel3d import Trainer3D

__all__ = ["LAYOUT", "recipe", "async_trace", "kill_during_write", "bit_flip", "check_cost", "draw_save_trace",
           "fault_tolerant_run", "draw_fault_tolerant_run", "FT_REPLICAS"]

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
    seconds, counted, wire = {False: [], True: []}, {False: 0.0, True: 0.0}, {False: None, True: None}
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
        counted[checked] = log.bytes_sent / (steps - 1)
        if log.observed_bytes_sent is not None:
            wire[checked] = log.observed_bytes_sent / (steps - 1)
    grad_bytes = sum(p.numel() * p.element_size() for p in t.dense_params)
    on_wire = None if None in wire.values() else wire[True] - wire[False]
    return (seconds, counted[True] - counted[False], on_wire, grad_bytes, len(t.dense_params))


def check_cost(steps: int = 8) -> dict:
    """Seconds per step with and without the check (median, min and max over alternating runs, dp 2), the
    check's bytes per step and rank as the algorithm counts them (the checked run's minus the plain run's, from
    the communication log) and as the socket took them (:mod:`minipar.wire`; None if unknown), the gradient's
    bytes and tensors."""
    seconds, check_bytes, wire_bytes, grad_bytes, tensors = launch(_cost_rank, 2, recipe(steps), steps,
                                                                   quiet=True)[0]
    spread = {k: (statistics.median(v), min(v), max(v)) for k, v in seconds.items()}
    return {"plain_s": spread[False], "checked_s": spread[True], "check_bytes": check_bytes,
            "check_wire_bytes": wire_bytes, "grad_bytes": grad_bytes, "tensors": tensors}


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


FT_REPLICAS = 3                                          # replica groups of one rank each


def ft_recipe(steps=6):
    """The tiny GPT (1 layer, width 8) in float64, a global batch of 6 rows: 2 per replica."""
    r = gpt_recipe(steps=steps, batch_size=6, seq_len=8, n_layer=1, n_embd=8, n_head=2)
    r.dtype = torch.float64
    return r


def fault_tolerant_run(steps: int = 6, kill_step: int = 2) -> dict:
    """Three replica groups; replica 1 SIGKILLed inside step ``kill_step`` (after its gradient entered the
    others' all-reduce, before its vote), restarted once a step was committed without it. The run, its events,
    the losses of one device over the committed rows and of the run no replica left, and max |Δ| between every
    replica's final parameters and the one device's over the committed rows."""
    recipe, t0 = ft_recipe(steps), time.perf_counter()
    result = replicas.run(recipe, replicas=FT_REPLICAS, micro_batches=1,
                          plan=FaultPlan(replica=1, rank=0, step=kill_step))
    seconds = time.perf_counter() - t0
    committed = replicas.committed_reference(recipe, FT_REPLICAS, result.committed)
    straight = replicas.uninterrupted_reference(recipe, FT_REPLICAS)
    diff = max(float((p[n] - committed.params[n]).abs().max()) for p in result.params.values() for n in p)
    first = result.params[0]
    identical = all(torch.equal(first[n], p[n]) for p in result.params.values() for n in first)
    return {"result": result, "events": replicas.run_events(result), "kill_step": kill_step, "seconds": seconds,
            "rows_per_replica": recipe.batches[0][0].shape[0] // FT_REPLICAS, "committed_losses": committed.losses,
            "uninterrupted_losses": straight.losses, "max_diff": diff, "identical": identical}


def _rounds(events):
    """(round's quorum event, its commit or abort event) for every round, in order."""
    decided = {e["round"]: e for e in events if e["kind"] in ("commit", "abort")}
    return [(e, decided[e["round"]]) for e in events if e["kind"] == "quorum" and e["round"] in decided]


def _draw_timeline(events, ax):
    lane = lambda r: FT_REPLICAS - 1 - r                                 # noqa: E731 replica 0 on top
    members_before = None
    for quorum, decision in _rounds(events):
        ok = decision["kind"] == "commit"
        for r in quorum["members"]:
            ax.barh(lane(r), decision["t"] - quorum["t"], left=quorum["t"], height=0.6, edgecolor="white",
                    color="tab:green" if ok else "tab:red", hatch=None if ok else "//", alpha=0.8 if ok else 0.6)
            ax.text((quorum["t"] + decision["t"]) / 2, lane(r), str(quorum["step"]), ha="center", va="center",
                    fontsize=7, color="white" if ok else "black")
        if quorum["members"] != members_before:
            ax.axvline(quorum["t"], color="grey", ls=":", lw=1)
            ax.text(quorum["t"], FT_REPLICAS - 0.45, "quorum {" + ",".join(map(str, quorum["members"])) + "}",
                    fontsize=7, rotation=20, ha="left")
            members_before = quorum["members"]
    for e in events:
        if e["kind"] == "death":
            ax.plot(e["t"], lane(e["replica"]), "kx", ms=10, mew=2)
            ax.text(e["t"], lane(e["replica"]) - 0.55, "SIGKILL", fontsize=7, ha="center")
            back = next(s["t"] for s in events if s["kind"] == "spawn" and s["replica"] == e["replica"]
                        and s["t"] > e["t"])
            ax.barh(lane(e["replica"]), back - e["t"], left=e["t"], height=0.2, color="lightgrey")
            ax.text((e["t"] + back) / 2, lane(e["replica"]) + 0.2, "absent, then restarted", fontsize=7, ha="center")
        elif e["kind"] == "heal_start":
            end = next(h for h in events if h["kind"] == "heal_end" and h["round"] == e["round"])
            ax.barh(lane(e["replica"]) - 0.38, end["seconds"], left=e["t"], height=0.15, color="tab:purple")
            ax.text(e["t"], lane(e["replica"]) - 0.62, f"healed from {e['source']} ({1e3 * end['seconds']:.0f} ms)",
                    fontsize=7, color="tab:purple")
    ax.set_yticks([lane(r) for r in range(FT_REPLICAS)], [f"replica {r}" for r in range(FT_REPLICAS)])
    ax.set_ylim(-0.9, FT_REPLICAS + 0.1)
    ax.set_xlabel("seconds (green: a committed step; red, hatched: an aborted round, the lost work)")


def draw_fault_tolerant_run(ft: dict):
    """Two panels: the timeline per replica (rounds by step, the death, quorum changes, the heal) and the loss
    per committed step beside the run no replica left."""
    import matplotlib.pyplot as plt
    fig, (timeline, curve) = plt.subplots(1, 2, figsize=(12, 3.2), gridspec_kw={"width_ratios": [2, 1]})
    _draw_timeline(ft["events"], timeline)
    timeline.set_title("each replica's rounds (the step in the bar)")
    losses = ft["result"].losses
    steps = [s for s, _, _ in losses]
    curve.plot(steps, ft["uninterrupted_losses"], "o-", color="grey", label="no replica lost")
    curve.plot(steps, [l for _, l, _ in losses], "s--", color="tab:green", label="replica 1 lost")
    for s, l, n in losses:
        if n < FT_REPLICAS:
            curve.annotate(f"{n} of {FT_REPLICAS}", (s, l), textcoords="offset points", xytext=(4, 6), fontsize=7)
    curve.set_xlabel("step")
    curve.set_ylabel("loss (mean over the step's rows)")
    curve.legend(fontsize=8)
    fig.tight_layout()
    return fig

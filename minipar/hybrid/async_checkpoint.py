"""Asynchronous checkpoints: snapshot to host memory, write in the background, train on (as PyTorch's
``torch.distributed.checkpoint.async_save`` does: a staging copy, then a thread that writes it).

A synchronous save (:func:`minipar.hybrid.checkpoint.save`) blocks training for the whole save, C = S + W:
the snapshot S (gather the shards, copy them to CPU memory) and the write W (serialise, write, hash the files,
rename). An asynchronous save blocks only for S; W runs on a thread while the next steps train::

    main thread   |step k|S|step k+1|step k+2|...      S = checkpoint.snapshot: CPU copies of what this rank writes
    writer thread           |---- W: checkpoint.write ----|  closed: latest names step k

The files, the manifest and the order of renames are exactly the synchronous save's (:func:`checkpoint.write`
runs on the thread), so the crash guarantees are the same: until ``latest`` is replaced the previous complete
checkpoint stays the one a restart loads; a kill mid-write leaves a ``step-N.partial`` that nothing names. What
changes is how much a crash loses: while a write is in flight the newest complete checkpoint is the one before,
so a crash loses up to one interval plus the write (:mod:`minipar.debug.checkpoint_interval`).

Three rules make it safe:

- the snapshot is a copy (``to_full`` clones, then ``.cpu()``), taken with the RNG state at the same moment, so
  the optimizer may change the parameters as soon as :meth:`AsyncCheckpointer.save` returns;
- one save in flight: the next :meth:`~AsyncCheckpointer.save` (and :meth:`~AsyncCheckpointer.finish`) first
  waits for the previous write, and re-raises its error naming the rank;
- the writer's barriers run on a process group of their own (gloo, created by every rank at construction), so
  they never interleave with the training's collectives on the default group (DCP's docs advise the same:
  a separate gloo group for async checkpointing).
"""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

from . import checkpoint

__all__ = ["AsyncCheckpointer", "save_timeline", "overlaps"]


class AsyncCheckpointer:
    """Checkpoints of ``trainer`` (a :class:`~minipar.hybrid.parallel3d.Trainer3D`) into ``directory``, written
    in the background. Construct it on every rank (it creates a process group: a collective). ``run``, ``keep``:
    as :func:`checkpoint.save`. Test hooks: ``before_write(step)`` runs on the writer thread before it writes
    (a slow disk: ``time.sleep``); ``crash_rank`` kills that rank halfway through writing its shard.

    ``events``: (what, step, seconds on ``clock``) of "snapshot_start", "snapshot_done", "write_closed" (the
    checkpoint complete, ``latest`` replaced) and, where the loop calls :meth:`step_started`, "step_start"."""

    def __init__(self, trainer, directory: str, *, run: dict | None = None, keep: int | None = None,
                 before_write=None, crash_rank: int | None = None, clock=time.perf_counter):
        self.trainer, self.directory, self.run, self.keep = trainer, directory, run, keep
        self.before_write, self.crash_rank, self.clock = before_write, crash_rank, clock
        self.group = dist.new_group(backend="gloo")          # the writer's barriers: never the training's group
        self.events: list = []
        self._thread, self._error, self._folder = None, None, None
        self.in_flight: int | None = None                   # the step being written, None when none is

    def mark(self, what: str, step: int) -> None:
        self.events.append((what, step, self.clock()))

    def step_started(self, step: int) -> None:
        """The training loop says a step began (for the trace: does it start before the write closed?)."""
        self.mark("step_start", step)

    def save(self, step: int) -> None:
        """Snapshot the state after ``step`` global steps (a collective, blocking) and start writing it on a
        thread; returns as soon as the copy is taken. Waits for the previous save first (one in flight)."""
        self.wait()
        self.mark("snapshot_start", step)
        snap = checkpoint.snapshot(self.trainer)
        self.mark("snapshot_done", step)
        self.in_flight = step
        self._thread = threading.Thread(target=self._write, args=(snap, step, self.crash_rank), daemon=True,
                                        name=f"minipar-checkpoint-{step}")
        self._thread.start()

    def _write(self, snap: dict, step: int, crash_rank: int | None) -> None:
        try:
            if self.before_write is not None:
                self.before_write(step)
            self._folder = checkpoint.write(self.trainer, snap, self.directory, step, wait=self._barrier,
                                            run=self.run, keep=self.keep, crash_rank=crash_rank)
            self.mark("write_closed", step)
        except BaseException as exc:                      # re-raised on the training thread by wait()
            self._error = exc

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def wait(self) -> str | None:
        """Block until the write in flight (if any) is complete; return its folder (None if none was in
        flight). A write that failed raises here, naming this rank."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, folder, error = None, self._folder, self._error
        self._error, self.in_flight = None, None
        if error is not None:
            raise RuntimeError(f"rank {dist.get_rank()}: the background checkpoint write into {self.directory} "
                               f"failed: {error}") from error
        return folder

    def finish(self) -> str | None:
        """The end of training: wait for the last write (every rank must call it before exiting)."""
        return self.wait()


def save_timeline(events: list) -> list[dict]:
    """One row per asynchronous save from :attr:`AsyncCheckpointer.events`: {"step", "snapshot": (start, end),
    "write": (snapshot end, write closed), "next_step_start": the first step started after the snapshot, or
    None}, times in seconds after the first event."""
    t0 = min(t for *_, t in events)
    at = {(what, step): t - t0 for what, step, t in events}
    starts = sorted(t - t0 for what, _, t in events if what == "step_start")
    rows = []
    for what, step, _ in events:
        if what != "snapshot_done":
            continue
        done = at[("snapshot_done", step)]
        later = [t for t in starts if t >= done]
        rows.append({"step": step, "snapshot": (at[("snapshot_start", step)], done),
                     "write": (done, at.get(("write_closed", step))), "next_step_start": later[0] if later else None})
    return rows


def overlaps(events: list) -> list[int]:
    """The saves whose next training step started before their file was closed: the steps whose write ran
    beside training (an empty list for a synchronous save)."""
    return [r["step"] for r in save_timeline(events)
            if r["next_step_start"] is not None and r["write"][1] is not None and r["next_step_start"] < r["write"][1]]

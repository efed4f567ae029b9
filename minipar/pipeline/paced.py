"""Paced pipeline runs: every action takes a fixed, calibrated wall time, so a timeline shows the schedule.

On a laptop 4 ranks share 2 cores (and the machine may be busy with other work): an action's wall time then
depends on who else runs, and a measured timeline shows CPU contention, not the schedule (measured: 51-75 %
idle against 16-27 % simulated, 1F1B idler than GPipe). In a *paced* run each action computes, then sleeps
until its slot has elapsed, and only then posts its messages, each followed by the time it was posted:

    begin = max(this rank's previous action ended, the input was sent)      end = begin + slot(kind)

which is the simulator's rule (:func:`minipar.pipeline.simulate.simulate`, transfers free). The transfer
and the waiting rank's wake-up happen *inside* the receiver's slot, so loopback latency and scheduling
delays (milliseconds, up to ~100 ms on an oversubscribed machine) do not show as idle; the receiver's
``wait`` rows keep the real arrival times, and the benchmark shows the idle counting them too.

The slots are fixed before training, from *unloaded* timings (:func:`unloaded_times`: the ranks take turns,
one times its own stages' F / BW (or B / W) while the others wait; the fastest of 10 repetitions), scaled up
so that even a slowed-down compute fits in its slot: ``slot = s · t`` with ``s = max(margin, min_slot /
min t)`` — the measured ratios between kinds are kept. The simulator run with ``Pace.costs`` then predicts
the idle fraction. An action whose compute (with its input's transfer) outlasted its slot is counted in
``PipelineRun.overruns``: then the machine was too busy for the chosen slots. The slots stay on the
schedule's clock (the next action's slot is shortened to catch up), so one late action does not shift all
that follow; the late span itself shows in the timeline.

The numbers trained are unchanged: pacing only waits (the result equals one device, as unpaced). The log
of a paced run also holds the 8-byte send times.

How: :func:`paced` turns any rank class (:class:`~minipar.pipeline.runtime.PipelineRank`, PipeDream's) into
its paced twin with :class:`PacedRank`, which fills the runtime's seams: ``post`` (defer a send to the
slot's end), ``wait_for`` (also receive when the sender's slot ended) and ``action_done`` (:meth:`PacedRank.hold`).
It goes on top of a timed class (``paced(timed(cls))``, :mod:`minipar.pipeline.timeline`), whose rows then
show the slots: a deferred send passes through the timeline's ``post`` when it is really posted.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch

from .. import comm
from ..tensor.layers import recompute_context_fn
from .simulate import Costs

__all__ = ["Pace", "PacedRank", "paced", "calibrate", "unloaded_times", "check", "resolve"]

SENT_AT_TAG = 1 << 24     # tag offset of the message carrying when a tensor was sent


@dataclass(frozen=True)
class Pace:
    """Slot length in seconds of an ``F``, ``B`` and ``W`` action as executed (one chunk's, if v > 1);
    a full backward ``BW`` gets ``B + W``, as the simulator's costs say."""
    F: float
    B: float
    W: float

    def slot(self, kind: str) -> float:
        return self.B + self.W if kind == "BW" else getattr(self, kind)

    def costs(self, v: int = 1) -> Costs:
        """The simulator's costs for this pace (the simulator's costs are per whole rank-stage: x v)."""
        return Costs(F=v * self.F, B=v * self.B, W=v * self.W)

    @classmethod
    def from_times(cls, times: dict, margin: float = 4.0, min_slot: float = 0.025) -> "Pace":
        """Slots ``s · t`` for unloaded times ``t`` = {kind: seconds} (F and BW, or F, B and W), with
        ``s = max(margin, min_slot / min t)``, rounded up to 0.1 ms. Without B and W, B = W = BW / 2."""
        t = dict(times)
        if "B" not in t or "W" not in t:
            t["B"] = t["W"] = t["BW"] / 2
        scale = max(margin, min_slot / min(t["F"], t["B"], t["W"]))
        up = lambda x: math.ceil(scale * x * 1e4) / 1e4          # noqa: E731
        return cls(up(t["F"]), up(t["B"]), up(t["W"]))


class PacedRank:
    """Mixed in before a rank class by :func:`paced`: every action held to its slot of ``self.pace``."""
    pace: Pace = None
    overruns = 0                  # actions whose compute outlasted their slot

    def begin_step(self) -> None:
        super().begin_step()
        self.slot_end, self.deferred = self.clock(), []

    def post(self, t, dst: int, tag: int, to_stage: int, microbatch: int) -> None:
        self.deferred.append((t, dst, tag, to_stage, microbatch))      # posted when the slot ends (hold)

    def wait_for(self, buf, src: int, tag: int, stage: int, microbatch: int) -> None:
        super().wait_for(buf, src, tag, stage, microbatch)
        sent = torch.empty(1, dtype=torch.float64, device=self.device)  # the slot starts when the sender's
        comm.irecv(sent, src, self.group, tag + SENT_AT_TAG).wait()       # slot ended (sent along)
        self.input_arrived = float(sent)

    def action_done(self, kind: str) -> None:
        self.hold(kind)
        super().action_done(kind)        # a timeline (minipar.pipeline.timeline) ends the action's span here

    def hold(self, kind: str) -> None:
        """Sleep until the action's slot is over, then post its sends, each followed by the time the slot
        ended (the receiver's slot starts then: the transfer is inside it, not idle). Slots are kept on the
        schedule's clock (``slot_end``), so wake-up delays do not add up along the pipeline."""
        begin = max(self.slot_end, self.input_arrived)     # this rank free / the input sent, on that clock
        self.slot_end = begin + self.pace.slot(kind)
        left = self.slot_end - self.clock()
        if left > 0:
            time.sleep(left)
        else:          # computing (or the input's transfer) took longer: late, the next slot catches up
            self.overruns += 1
        for t, dst, tag, to_stage, mb in self.deferred:
            super().post(t, dst, tag, to_stage, mb)                   # the rank class's send, now
            sent = torch.tensor([self.slot_end], dtype=torch.float64, device=self.device)
            self.pending_sends.append((comm.isend(sent, dst, self.group, tag + SENT_AT_TAG), sent))
        self.deferred = []


@functools.cache
def paced(rank_class: type) -> type:
    """``rank_class`` with :class:`PacedRank` mixed in (one class per rank class)."""
    return type(f"Paced{rank_class.__name__}", (PacedRank, rank_class), {})


def _time_stage(module, x, target, is_last: bool, kinds: set, reps: int, recompute: bool, loss_fn) -> dict:
    """Fastest seconds of F, BW (and B, W) of ``module`` on input ``x`` (one micro-batch), on this rank."""
    from torch.utils.checkpoint import checkpoint
    out = {k: [] for k in kinds | {"F"}}
    gen = torch.Generator().manual_seed(0)
    params = [q for q in module.parameters() if q.requires_grad]
    for _ in range(reps + 1):                                  # the first is a warm-up
        xin = x.detach().requires_grad_(x.is_floating_point())
        t0 = time.perf_counter()
        y = (checkpoint(module, xin, use_reentrant=False, context_fn=recompute_context_fn(module)) if recompute
             else module(xin))
        if is_last:
            y = loss_fn(y, target)
        t1 = time.perf_counter()
        dy = None if is_last else torch.randn(y.shape, generator=gen, dtype=y.dtype)
        if "BW" in kinds:
            t2 = time.perf_counter()
            torch.autograd.backward(y, dy, retain_graph="B" in kinds)
            out["BW"].append(time.perf_counter() - t2)
        if "B" in kinds:
            t2 = time.perf_counter()
            if xin.requires_grad:
                torch.autograd.grad(y, xin, dy, retain_graph=True)
            t3 = time.perf_counter()
            torch.autograd.grad(y, params, dy, allow_unused=True)
            out["B"].append(t3 - t2)
            out["W"].append(time.perf_counter() - t3)
        out["F"].append(t1 - t0)
    for q in params:
        q.grad = None
    return {k: min(v[1:]) for k, v in out.items()}       # the least disturbed: closest to unloaded


def unloaded_times(runner, inputs: list, targets: list, reps: int = 10) -> dict:
    """{kind: seconds}: the slowest of every pipeline rank's stages, each rank timed while the others wait
    (their turn in a ring of barriers), so the timings are not shared with the other ranks of this run.
    Collective over the pipeline group."""
    kinds = {a.kind for a in runner.actions}
    kinds = ({"B", "W"} if kinds & {"B", "W"} else set()) | ({"BW"} if "BW" in kinds else set())
    names = ["F", "BW", "B", "W"]
    mine = torch.zeros(len(names), dtype=torch.float64)
    for turn in runner.pp_ranks:
        comm.all_reduce(torch.zeros(1), group=runner.group)          # a barrier: one rank at a time
        if torch.distributed.get_rank() != turn:
            continue
        for stage in runner.stages:
            shape, dtype = runner.shapes[stage]
            x = inputs[0] if stage == 0 else torch.randn(shape, generator=torch.Generator().manual_seed(1),
                                                         dtype=dtype)
            t = _time_stage(runner.module(stage, 0), x, targets[0], stage == runner.last, kinds, reps,
                            runner.recompute, runner.loss_fn)
            mine = torch.maximum(mine, torch.tensor([t.get(k, 0.0) for k in names], dtype=torch.float64))
    comm.all_reduce(mine, op=torch.distributed.ReduceOp.MAX, group=runner.group)
    return {k: float(x) for k, x in zip(names, mine) if x > 0}


def calibrate(runner, inputs: list, targets: list, margin: float = 4.0, min_slot: float = 0.025) -> Pace:
    """The :class:`Pace` of this run: :func:`unloaded_times` scaled by :meth:`Pace.from_times`."""
    return Pace.from_times(unloaded_times(runner, inputs, targets), margin, min_slot)


def check(pace) -> None:
    """ValueError unless ``pace`` is None, "auto", a dict of :func:`calibrate`'s options or a Pace."""
    if pace is None or pace == "auto" or isinstance(pace, Pace):
        if isinstance(pace, Pace) and min(pace.F, pace.B, pace.W) <= 0:
            raise ValueError(f"every slot of a Pace must be positive, got {pace}")
        return
    if isinstance(pace, dict) and set(pace) <= {"margin", "min_slot"}:
        if pace.get("margin", 1) < 1 or pace.get("min_slot", 0) < 0:
            raise ValueError(f"pace: margin must be >= 1 and min_slot >= 0, got {pace}")
        return
    raise ValueError(f"pace must be None, 'auto', {{'margin': .., 'min_slot': ..}} or a Pace, got {pace!r}")


def resolve(pace, runner, inputs: list, targets: list) -> Pace:
    """The Pace a run uses: ``pace`` itself, or calibrated (``"auto"`` or a dict of options)."""
    if isinstance(pace, Pace):
        return pace
    return calibrate(runner, inputs, targets, **(pace if isinstance(pace, dict) else {}))

"""Paced compute: every block's forward and every block's backward held to a fixed wall-clock slot, so a
step's time shows what its communication overlaps, not who won the CPU.

On a laptop 4 ranks share 2 cores with gloo's threads: an all-reduce launched during backward competes with
the backward for the same cores, so "bucketed DDP is faster than one bucket" or "ZeRO-3's prefetch saves
time" changes sign from run to run. On a GPU the device computes while the host CPU (and the NIC) are free.
A *paced* block stands in for that device: it computes, then sleeps until its slot has elapsed::

    forward of a block:   begin = when its forward starts        end = begin + forward_s
    backward of a block:  begin = when the gradient reaches it   end = begin + backward_s

so a rank holds the CPU only for the block's real compute, and during the rest of the slot gloo's threads
get the cores — as a GPU's copy engine and network run beside its kernels. A collective issued before or
inside a slot then costs nothing when it ends before the slot does (hidden), and what a step adds beyond
its slots is the communication nothing hid (exposed). The same idea as the paced pipeline runs of chapter 04
(:mod:`minipar.pipeline.paced`), there per pipeline action, here per block.

Where the slot starts matters. The pacing wraps the block's own ``forward`` (an instance attribute, so
``block(x)`` still runs every module hook around it): a strategy's forward pre-hook that all-gathers the
block's parameters (ZeRO-3, :mod:`minipar.data.zero`) runs *before* the slot begins, and its tensor hook
on the block's output, which gathers them again for the backward, runs *before* the backward slot begins
(the identity this wrapper puts on the output is downstream of that hook). A gather that was not prefetched
is therefore paid outside the slot, as on a device, where a kernel cannot start before its weights arrive.
The backward slot ends where the gradient reaches the block's inputs (an identity on them, which sleeps in
its backward); autograd runs a parameter's AccumulateGrad (and DDP's gradient hooks, which launch buckets)
before that node, so a bucket filled by this block leaves before the sleep and travels during it.

A block whose compute outlasts its slot is counted in :attr:`Pacer.overruns` (the slot was too short for
this machine now; the step then shows CPU time again). Pacing only waits: the numbers trained are those of
the unpaced model. Its backward slot needs an input that requires a gradient (a transformer block's
activations always do); without one the backward runs unpaced and is counted in :attr:`Pacer.unpaced`.

    pacer = pace(model.blocks, forward_s=0.005, backward_s=0.010)
    ...train...
    pacer.remove()          # the blocks' own forward again
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..check import one_thread

__all__ = ["Pacer", "pace", "size_slots", "median_wake", "alternating_steps", "spread", "verdict", "unsteady",
           "paired_ratios"]


class Pacer:
    """The pacing of ``blocks``: each one's forward held to ``forward_s`` seconds, its backward to
    ``backward_s`` (see the module docstring). ``held``: slots held; ``overruns``: those whose compute took longer."""

    def __init__(self, blocks, forward_s: float, backward_s: float):
        if forward_s <= 0 or backward_s <= 0:
            raise ValueError(f"slots must be positive seconds, got forward_s={forward_s}, backward_s={backward_s}")
        self.forward_s, self.backward_s = forward_s, backward_s
        self.held = self.overruns = self.unpaced = 0     # slots held; of them ran long; backwards not held
        self.late = 0.0                               # how late the last sleep woke up (seconds)
        self.woke_late: list = []                     # how late each sleep woke up (seconds): busy.disturbed reads it
        self.computed = {"forward": [], "backward": []}   # seconds each held slot's compute took, by kind
        self.blocks = list(blocks)
        for block in self.blocks:
            if "forward" in block.__dict__:
                raise ValueError(f"{type(block).__name__} is paced already (its forward is replaced)")
            block.forward = self._paced(block.forward)

    def remove(self) -> None:
        """Give every block its own forward back."""
        for block in self.blocks:
            del block.forward

    def begin(self) -> float:
        """A slot begins now, less how late the last sleep woke up: wake-up delays (milliseconds on a busy
        machine) do not add up slot after slot; a collective waited for in between still counts."""
        begin, self.late = time.perf_counter() - self.late, 0.0
        return begin

    def hold(self, begin: float, slot: float, kind: str | None = None) -> None:
        """Sleep until ``begin + slot`` (perf_counter seconds); count an overrun if that moment has passed.
        ``kind`` ("forward" / "backward"): note in :attr:`computed` how long the compute took."""
        end = begin + slot
        self.held += 1
        now = time.perf_counter()
        if kind is not None:
            self.computed[kind].append(now - begin)
        left = end - now
        if left > 0:
            time.sleep(left)
            self.late = max(0.0, time.perf_counter() - end)
            self.woke_late.append(self.late)
        else:
            self.overruns += 1

    def _paced(self, forward):
        def paced_forward(*args, **kwargs):
            begin = self.begin()
            slot = {"backward_begin": None}          # this call's backward: set when the gradient reaches it
            marked = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
            if marked and torch.is_grad_enabled():
                ins = iter(_EndBackward.apply(self, slot, *(args[i] for i in marked)))
                args = tuple(next(ins) if i in marked else a for i, a in enumerate(args))
            elif torch.is_grad_enabled():
                self.unpaced += 1
            out = forward(*args, **kwargs)
            if torch.is_tensor(out) and out.requires_grad:
                out = _BeginBackward.apply(self, slot, out)
            self.hold(begin, self.forward_s, "forward")
            return out
        return paced_forward


class _BeginBackward(torch.autograd.Function):
    """Identity on a block's output; its backward (the block's backward about to start) notes the time."""
    @staticmethod
    def forward(ctx, pacer, slot, out):
        ctx.pacer, ctx.slot = pacer, slot
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.slot["backward_begin"] = ctx.pacer.begin()
        return None, None, grad


class _EndBackward(torch.autograd.Function):
    """Identity on a block's inputs; its backward (the block's backward done) sleeps to the slot's end."""
    @staticmethod
    def forward(ctx, pacer, slot, *inputs):
        ctx.pacer, ctx.slot = pacer, slot
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        begin = ctx.slot["backward_begin"]
        if begin is not None:
            ctx.pacer.hold(begin, ctx.pacer.backward_s, "backward")
        return (None, None, *grads)


def pace(blocks, forward_s: float, backward_s: float) -> Pacer:
    """Pace ``blocks`` (modules, e.g. ``model.blocks``): see :class:`Pacer`."""
    return Pacer(blocks, forward_s, backward_s)


def size_slots(pacers, floor: tuple, margin: float = 2.0, quantile: float = 0.9, ceiling: float = 0.25,
               group=None) -> tuple:
    """Size the slots of ``pacers`` from the compute they measured (:attr:`Pacer.computed`, then cleared):
    each kind's slot is ``margin`` times the ``quantile`` of its compute times (the highest over the ranks of
    ``group``: collective when a process group is up), never under ``floor`` (forward_s, backward_s) nor over
    ``ceiling`` seconds. Measured while the ranks compute together (and gloo moves buckets), so a slower or
    busier machine gets wider slots that still leave slack, instead of slots its compute overruns.
    Returns the (forward_s, backward_s) set; the held and overrun counts are reset."""
    widths = []
    for kind in ("forward", "backward"):
        took = sorted(t for p in pacers for t in p.computed[kind])
        q = took[min(len(took) - 1, int(quantile * len(took)))] if took else 0.0
        widths.append(q)
    widths = torch.tensor(widths, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(widths, op=dist.ReduceOp.MAX, group=group)
    forward_s, backward_s = (min(ceiling, max(lo, margin * float(w))) for lo, w in zip(floor, widths))
    for p in pacers:
        p.forward_s, p.backward_s = forward_s, backward_s
        p.held = p.overruns = p.unpaced = 0
        p.computed = {"forward": [], "backward": []}
        p.woke_late = []
    return forward_s, backward_s


def median_wake(pacers, group=None) -> float:
    """The median of how late the ``pacers``' sleeps woke up after their slots' ends (seconds), over every rank of
    ``group`` (collective when a process group is up: each rank's median, the highest taken)."""
    woke = sorted(t for p in pacers for t in p.woke_late)
    median = torch.tensor([woke[len(woke) // 2] if woke else 0.0], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median)


def alternating_steps(steps: dict, rounds: int, group=None, warmup: int = 0) -> dict:
    """{name: [seconds of each timed round]}: every round runs each callable of ``steps`` once, in alternating
    order (so a slow spell of the machine falls on all of them), after ``warmup`` untimed rounds. In a process
    group, each call starts after a barrier and is timed on the slowest rank of ``group`` (an all-reduce of the
    max; collective: every rank calls it with the same ``steps``); without one, in this process alone.
    Every step runs on one intra-op thread (:func:`minipar.check.one_thread`, as every launched rank does):
    with two threads on a busy two-core machine a 10 ms step of a tiny model once took up to a second, each
    small kernel's second thread waiting for a core, and the timing measured that wait."""
    together = dist.is_available() and dist.is_initialized()
    names, times = list(steps), {n: [] for n in steps}
    with one_thread():
        for i in range(warmup + rounds):
            for name in (names if i % 2 == 0 else names[::-1]):
                if together:
                    dist.barrier(group)
                t0 = time.perf_counter()
                steps[name]()
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                if together:
                    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
                if i >= warmup:
                    times[name].append(float(took))
    return times


def spread(seconds) -> str:
    """'median [min – max] ms' of a list of seconds."""
    return f"{statistics.median(seconds) * 1e3:.1f} [{min(seconds) * 1e3:.1f} – {max(seconds) * 1e3:.1f}] ms"


def verdict(fast, slow) -> str:
    """How steps ``fast`` compare with ``slow`` (lists of seconds): "apart" (every fast step below every slow
    one), "median outside" (a typical step of one lies outside the other's [min – max]: the fast median below
    the slow minimum, or the slow median above the fast maximum; an outlier step widens one range), else "tie"."""
    if max(fast) < min(slow):
        return "apart"
    if statistics.median(fast) < min(slow) or statistics.median(slow) > max(fast):
        return "median outside"
    return "tie"


def unsteady(seconds: dict, slack: float = 1.5) -> bool:
    """Unpaced steps disturbed by other load ({name: [seconds]} from :func:`alternating_steps`): for some name, a
    quarter of its steps or more took over ``slack`` times its fastest. Judged on the steps themselves, not on
    the load average (which on a shared machine stays high while a quiet minute times steadily)."""
    return any(statistics.quantiles(t, n=4, method="inclusive")[2] > slack * min(t) for t in seconds.values())


def paired_ratios(a: list, b: list, loaded: bool) -> tuple:
    """(fastest ÷ fastest, the per-round ratios' median, their middle half (q1, q3), a verdict) of steps ``a``
    against ``b``, timed in the same rounds of :func:`alternating_steps`. A round runs the two back to back, so a
    busy spell slows both and leaves their ratio, where two overlapping [min – max] ranges (:func:`verdict`)
    say nothing. The verdict: "not compared (load)" when ``loaded`` (:func:`unsteady`); else "slower" /
    "faster" when the middle half of the ratios lies above / below 1, "a tie" when it straddles 1."""
    ratios = [x / y for x, y in zip(a, b)]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    verdict_ = "not compared (load)" if loaded else "slower" if q1 > 1 else "faster" if q3 < 1 else "a tie"
    return min(a) / min(b), median, (q1, q3), verdict_

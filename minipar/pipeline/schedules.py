"""Pipeline schedules as data: who computes what, in which order.

A schedule is, for every pipeline rank, the ordered list of its :class:`Action`\\ s. The same lists drive the
runtime that trains with them (:mod:`minipar.pipeline.runtime`), the simulator that plays them on a clock
(:mod:`minipar.pipeline.simulate`) and the Gantt charts, all through one lowering into messages
(:mod:`minipar.pipeline.lowering`). The model is cut into ``p · v`` stages; stage ``s`` lives on rank
``s % p`` as its chunk ``s // p`` (round-robin, as in *并行策略简介*: 16 layers, 4 ranks, v = 2 puts layers 0-1 and
8-9 on rank 0). :class:`Action`, :class:`Schedule`, the placement and :func:`validate` sit one floor lower,
in :mod:`minipar.pipeline.actions`, which every schedule module builds on.

Action kinds:

* ``F``  forward of one micro-batch through one stage;
* ``BW`` the full backward (input gradient and weight gradient together), as GPipe and 1F1B do it;
* ``B``  the input gradient only (what the previous stage waits for), and
* ``W``  the weight gradient only (nobody waits for it): the split of zero-bubble schedules.

Schedules (p ranks, m micro-batches, v chunks per rank):

=============  =====================================================  ==================================
name           order on rank r                                        bubble idle/total (unit costs)
=============  =====================================================  ==================================
naive          m = 1: F then BW, one rank at a time                   (p-1)/p
gpipe          all m forwards, then all m backwards (F-then-B)        (p-1)/(m+p-1)  (Huang et al. 2019)
1f1b           p-r-1 warm-up F, then F BW pairs, then cool-down BW    (p-1)/(m+p-1)  (PipeDream-Flush,
                                                                      Narayanan et al. 2019, 2021)
interleaved    1F1B over v chunks, micro-batches in groups of p       (p-1)/(v·m+p-1)  (Narayanan et al.
                                                                      2021, Megatron-LM)
zb-h1          1F1B with BW split into B and W, W filling the bubble  (p-1)/(3m+p-1) for F = B = W
                                                                      (Qi et al. 2023, zero bubble)
zb-v           V placement, 2 stages per rank, B/W split             ~0 for F = B = W (Qi et al. 2024)
dualpipev      V placement, F of one micro-batch beside BW of another (p-1)(F&B+B-3W) (DeepSeek-V3 2024)
v-min          V placement, a repeating block: memory 1/3 of ZB-V    ≈ 2/3 of 1F1B's (Qi et al. 2024)
v-half         V placement, a longer block, warm-up/cool-down          ≈ 1/2 of 1F1B's (Qi et al. 2024)
               reordered: memory 1/2 of ZB-V
=============  =====================================================  ==================================

The V schedules live in :mod:`minipar.pipeline.vschedules` (V-Half in :mod:`minipar.pipeline.vhalf`); their
``placement`` is ``"v"``: rank r holds stages r and 2p-1-r, so the first stage's input and the last stage's
loss sit on rank 0.

The bubble above is idle / (p · makespan). Megatron-LM (Narayanan et al. 2021) and the Ultra-Scale Playbook
divide the same idle time by the ideal (busy) time instead: (p-1)/m, (p-1)/(v·m) interleaved.
``bubble_formula(..., over="ideal")`` and :attr:`~minipar.pipeline.simulate.SimResult.bubble_ratio`.
"""
from __future__ import annotations

from .actions import V_SCHEDULES, Action, Schedule, needs, validate
from .vhalf import v_half
from .vschedules import dualpipe_v, v_min, zb_v

__all__ = ["Action", "needs", "Schedule", "SCHEDULES", "make_schedule", "naive", "gpipe", "one_f_one_b",
           "interleaved", "zb_h1", "zb_v", "dualpipe_v", "bubble_formula", "validate", "V_SCHEDULES"]


def naive(p: int, m: int = 1) -> Schedule:
    """The whole batch through stage 0, 1, ..., p-1, then back: one rank busy at a time."""
    validate("naive", p, m)
    return Schedule("naive", p, 1, 1, [[Action("F", r, 0), Action("BW", r, 0)] for r in range(p)])


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards in reverse order (as drawn in the GPipe paper). Every rank keeps
    the activations of all m micro-batches until its first backward."""
    validate("gpipe", p, m)
    return Schedule("gpipe", p, m, 1, [[Action("F", r, i) for i in range(m)] +
                                       [Action("BW", r, i) for i in reversed(range(m))] for r in range(p)])


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush: rank r does p-r-1 warm-up forwards, then alternates one forward and one backward,
    then drains the remaining backwards. At most p-r micro-batches are in flight on rank r."""
    validate("1f1b", p, m)
    actions = []
    for r in range(p):
        warmup = p - r - 1
        acts = [Action("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):                    # steady: F of a new one, BW of the oldest
            acts += [Action("F", r, warmup + i), Action("BW", r, i)]
        acts += [Action("BW", r, i) for i in range(m - warmup, m)]
        actions.append(acts)
    return Schedule("1f1b", p, m, 1, actions)


def _interleaved_order(p: int, v: int, k: int, backward: bool) -> tuple:
    """The k-th forward (or backward) on a rank: micro-batches go in groups of p through chunk 0, then the
    same group through chunk 1, ...; backwards visit the chunks in reverse. Returns (chunk, microbatch)."""
    chunk = (k // p) % v
    microbatch = (k // (p * v)) * p + k % p
    return (v - 1 - chunk if backward else chunk), microbatch


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (virtual pipeline): v chunks per rank, so a micro-batch crosses the ring v times.
    Warm-up on rank r: (v-1)·p + 2·(p-r-1) forwards (Narayanan et al. 2021, §2.2). Bubble / v."""
    validate("interleaved", p, m, v)
    if v == 1:
        sched = one_f_one_b(p, m)
        return Schedule("interleaved", p, m, 1, sched.actions)
    total = m * v
    actions = []
    for r in range(p):
        warmup = min((v - 1) * p + 2 * (p - r - 1), total)

        def fwd(k):
            c, i = _interleaved_order(p, v, k, backward=False)
            return Action("F", c * p + r, i)

        def bwd(k):
            c, i = _interleaved_order(p, v, k, backward=True)
            return Action("BW", c * p + r, i)
        acts = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [fwd(warmup + k), bwd(k)]
        acts += [bwd(k) for k in range(total - warmup, total)]
        actions.append(acts)
    return Schedule("interleaved", p, m, v, actions)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B whose backward is split into B (input gradient, on the critical path:
    the previous stage waits for it) and W (weight gradient: nobody waits for it). Rank r keeps r W's
    pending, so its B's go back upstream sooner and its W's fill the cool-down where 1F1B idles. Bubble
    (p-1)(F+B-W) instead of (p-1)(F+B+W); every rank holds at most p activations, 1F1B's peak (rank 0)."""
    validate("zb-h1", p, m)
    actions = []
    for r in range(p):
        warmup = p - r - 1
        acts = [Action("F", r, i) for i in range(warmup)]
        pending = []                                   # micro-batches whose W is still to do
        for i in range(m):
            if warmup + i < m:
                acts.append(Action("F", r, warmup + i))
            acts.append(Action("B", r, i))
            pending.append(i)
            if len(pending) > r:                       # rank r keeps r weight-gradients pending
                acts.append(Action("W", r, pending.pop(0)))
        acts += [Action("W", r, i) for i in pending]
        actions.append(acts)
    return Schedule("zb-h1", p, m, 1, actions)


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1,
             "zb-v": zb_v, "dualpipev": dualpipe_v, "v-min": v_min, "v-half": v_half}


def make_schedule(name: str, p: int, m: int, v: int = 1, n_layers: int | None = None) -> Schedule:
    """The schedule ``name`` for p ranks, m micro-batches, v chunks per rank (``interleaved`` only)."""
    validate(name, p, m, v, n_layers)
    if name == "interleaved":
        return interleaved(p, m, v)
    return SCHEDULES[name](p, m)


def bubble_formula(name: str, p: int, m: int, v: int = 1, over: str = "total") -> float:
    """The bubble with F = B = W = 1 (BW = 2) and free transfers. ``over="total"``: idle / (p · makespan),
    (p-1)/(v·m+p-1); ``over="ideal"``: idle / busy time, (p-1)/(v·m) (Megatron-LM's bubble time over
    ideal time, which interleaving divides by exactly v). ZB-H1: the bubble is (p-1)(F+B-W) = p-1 per
    rank next to 3m of work."""
    validate(name, p, m, v)
    if name in V_SCHEDULES:
        raise ValueError(f"{name}: no closed form here; play it on the clock with minipar.pipeline.simulate")
    if over not in ("total", "ideal"):
        raise ValueError(f"over must be 'total' (idle / whole step) or 'ideal' (idle / busy), got {over!r}")
    work = 3 * m if name == "zb-h1" else v * m          # per rank, in units of the bubble's p - 1 slots
    return (p - 1) / (work + (p - 1 if over == "total" else 0))

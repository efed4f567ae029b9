"""V-Half: the V placement at half of 1F1B's activation memory (Qi et al. 2024, "Pipeline Parallelism with
Controllable Memory", arXiv 2405.15362, §3-4).

The paper builds a schedule in four steps, all four done here:

1. **Building block** — the passes of one micro-batch on a clock of chunk slots (F = B = W = 1): F down the V
   and back up (stage s, then s+1 one slot later), then B back down. V-Half's block spaces its backward
   passes **two** slots apart (V-Min's one), so the block is longer and each activation lives longer.
2. **Repeating** — micro-batch i's block starts 6i slots after micro-batch 0's: every rank does one F, B
   and W of each of its two chunks every 6 slots, so a pass may only take a slot free *modulo 6* on its rank
   (a pass that would collide waits one slot more).
   The peak activation memory is then the block's *lifespans*: rank r holds ⌈ℓ₀/6⌉ + ⌈ℓ₁/6⌉ chunk
   activations, ℓ_c the slots from F to the end of W on chunk c. V-Half's lifespans add up to 6p + O(1) on
   every rank (6p+8 at p = 2..5, 6p+14 at p = 8): ≈ p chunk activations = p/2 stages, half of 1F1B's p
   (the paper's ⌊(p+2)/2⌋ stages; V-Min's lifespans ≈ 4p, ZB-V's ≈ 12p).
3. **Squeezing** — the simulator (and the runtime) start each pass as soon as its inputs are there, in the
   block order: the empty slots of the repeated blocks disappear without changing the order.
4. **Reordering** — in the warm-up and cool-down the memory is under the peak, so a rank whose next pass (in
   block order) is not ready runs, rather than wait, its oldest ready W (W only frees memory), or else its
   first ready F while it holds fewer than p chunk activations. That takes the bubble from the repeated
   block's ≈ 0.7·B down to ≈ B/2, B = (p-1)/(m+p-1) the 1F1B bubble, at T_F = T_B = T_W (m = 4p: 0.70 → 0.54
   at p = 4, 0.73 → 0.53 at p = 8).

Measured on the simulator (tests/test_pipeline_tables.py): bubble 0.45-0.65·B and at most p + 3 chunk
activations per rank for p = 2..8 and every m ≥ p; twice 1F1B's p2p volume, like every V. Any p ≥ 1 and
m ≥ 1 are accepted (the block is deadlock-free by construction: its order follows one clock).
"""
from __future__ import annotations

from .actions import Action, Schedule, needs, validate

__all__ = ["v_half", "v_half_block", "repeat_block"]

PERIOD = 6          # slots between two micro-batches' blocks: F, B, W of each of a rank's 2 chunks


def v_half_block(p: int, backward_gap: int = 2) -> dict:
    """Micro-batch 0's building block: {(kind, stage): slot}. F of stage s one slot after stage s-1's, B of
    stage s ``backward_gap`` slots after stage s+1's (one slot at the last stage and at the V's turn, both on
    one rank); a pass whose slot is taken modulo 6 on its rank moves on to the next free one. The two W's of
    a rank take its two slots left free modulo 6, the order that ends the activations' lives sooner."""
    if backward_gap < 1:
        raise ValueError(f"backward_gap must be at least 1 slot, got {backward_gap}")
    last = 2 * p - 1
    taken = [set() for _ in range(p)]                          # residues modulo 6 used on each rank
    block, t = {}, -1
    chain = [("F", s) for s in range(last + 1)] + [("B", s) for s in range(last, -1, -1)]
    for kind, s in chain:
        t += backward_gap if kind == "B" and s not in (last, p - 1) else 1
        rank = min(s, last - s)
        while t % PERIOD in taken[rank]:
            t += 1
        block[(kind, s)] = t
        taken[rank].add(t % PERIOD)
    for r in range(p):
        free = sorted(set(range(PERIOD)) - taken[r])
        first_after = lambda b, q: b + 1 + (q - b - 1) % PERIOD      # noqa: E731  first slot > b, ≡ q mod 6
        chunks = (last - r, r)
        block.update(min(({("W", s): first_after(block[("B", s)], q) for s, q in zip(chunks, order)}
                          for order in (free, free[::-1])), key=lambda w: sum(w.values())))
    return block


def v_half(p: int, m: int) -> Schedule:
    """V-Half on p ranks (stages r and 2p-1-r on rank r), m micro-batches: the building block
    (:func:`v_half_block`) repeated every 6 slots, each rank's passes in the order of their slots, then the
    warm-up and cool-down reordered under a memory cap of p chunk activations (:func:`_reorder`)."""
    validate("v-half", p, m, 2)
    order = repeat_block(v_half_block(p), p, m).actions
    return Schedule("v-half", p, m, 2, _reorder(p, order, cap=p), placement="v")


def repeat_block(block: dict, p: int, m: int) -> Schedule:
    """The building block repeated (micro-batch i's pass at slot 6i + its block slot), each rank's passes in
    the order of their slots: steps 1-2 of the construction, before the reordering (step 3, squeezing, is
    what the simulator and the runtime do with any order)."""
    order = []
    for r in range(p):
        timed = [(PERIOD * i + block[(kind, s)], kind, s, i)
                 for s in (r, 2 * p - 1 - r) for kind in "FBW" for i in range(m)]
        order.append([Action(kind, s, i) for _, kind, s, i in sorted(timed)])
    return Schedule("v-half", p, m, 2, order, placement="v")


def _reorder(p: int, order: list, cap: int) -> list:
    """Play ``order`` (each rank's passes in block order) on a clock of unit slots. A free rank runs its next
    pass if its input is there; else its oldest ready W; else its first ready F if it holds fewer than
    ``cap`` chunk activations; else it waits. Returns the order in which the passes ran. Cannot hang: the
    pass with the earliest block slot left always has its inputs (they have earlier slots)."""
    last = 2 * p - 1
    ends = {}                                                   # (kind, stage, mb) -> slot it ends
    left = [list(o) for o in order]
    ran = [[] for _ in range(p)]
    held = [0] * p                                              # chunk activations held (F done, W not)
    t = 0
    while any(left):
        for r in range(p):
            k = _pick(left[r], held[r] < cap, lambda a: _ready(a, last, ends, t)) if left[r] else None
            if k is None:
                continue
            a = left[r].pop(k)
            ends[(a.kind, a.stage, a.microbatch)] = t + 1
            held[r] += {"F": 1, "B": 0, "W": -1}[a.kind]
            ran[r].append(a)
        t += 1
    return ran


def _pick(left: list, may_grow: bool, ready) -> int | None:
    """Index in ``left`` of the pass to run now: the next one, else the oldest ready W, else (if memory may
    grow) the first ready F; None: wait."""
    if ready(left[0]):
        return 0
    for kinds in ("W", "F") if may_grow else ("W",):
        for k, a in enumerate(left):
            if a.kind == kinds and ready(a):
                return k
    return None


def _ready(a: Action, last: int, ends: dict, t: int) -> bool:
    """Whether ``a``'s input has been produced by slot t: F of the stage before, B of the stage after (the
    last stage: its own F, the loss), W: its own B."""
    need = needs(a, last)
    return need is None or ends.get(need, t + 1) <= t

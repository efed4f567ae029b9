"""V-shaped schedules: two stages per rank, placed so that the model goes down the ranks and back up.

With p ranks the model is cut into 2p stages and rank r holds stages r and 2p-1-r (``placement="v"``): a
micro-batch goes rank 0 → p-1 through stages 0..p-1, turns on rank p-1 (stages p-1 and p are both there:
the hand-over is local, no message), comes back p-1 → 0 through stages p..2p-1, and its loss is computed
on rank 0, which also holds its input. Backward retraces the V. Each rank has a *chunk 0* (stage r, on the
way down) and a *chunk 1* (stage 2p-1-r, on the way up).

* :func:`zb_v` — ZB-V (Qi et al. 2024, "Zero Bubble (Almost) Pipeline Parallelism", §6): the backward split
  into B (input gradient) and W (weight gradient) as in ZB-H1, and the V placement, whose warm-up reaches
  the loss after p ranks instead of 2p. With T_F = T_B = T_W the idle slots fill up with W's: bubble ≈ 0 at
  1F1B's activation memory (2p chunk activations = p stage activations on every rank), twice 1F1B's p2p
  traffic (each micro-batch crosses 2p-2 rank boundaries each way instead of p-1).
* :func:`dualpipe_v` — DualPipeV (DeepSeek-V3 technical report 2024; github.com/deepseek-ai/DualPipe): the
  V of DualPipe on p ranks. Its steady phase pairs the forward of one micro-batch on one chunk with the full
  backward of another on the other chunk ("F&B"): on a GPU the two run at once so that each one's
  communication hides behind the other's compute. **Here the pair is two consecutive actions, F then BW**,
  listed in ``Schedule.overlapped``: the runtime runs them one after the other; the simulator
  (``overlap=True``, the default) starts the pair only when both inputs are there and costs it
  F&B = F + B + W (no credit for overlap on a CPU). Then the idle per rank is the DualPipe README's
  (p-1)(F&B + B - 3W), B the full backward; played as two free actions it is (p-1)·F.

V-Min (:func:`v_min`, below) and V-Half (:func:`minipar.pipeline.vhalf.v_half`, its own file) are built from
a repeating building block instead (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory").

ZB-V and DualPipeV follow the phase structure of the published schedules (and of ``torch.distributed.pipelining``'s
``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``, which the chapter runs beside them), written here as
plain action lists so that the checker (:mod:`minipar.pipeline.checker`) and the simulator can read them.
"""
from __future__ import annotations

from .actions import Action, Schedule, validate
from .vhalf import repeat_block, v_half_block

__all__ = ["zb_v", "dualpipe_v", "v_min"]


class _Counter:
    """Rank r's builder: ``next(kind, chunk)`` appends the next micro-batch's ``kind`` on that chunk."""

    def __init__(self, p: int, r: int):
        self.stage = (r, 2 * p - 1 - r)                 # chunk 0 (down), chunk 1 (up)
        self.count = {}
        self.actions = []
        self.pending_w = []                             # (chunk, micro-batch) whose W is still to do
        self.pairs = []                                 # indices i: actions i, i+1 are one F&B

    def next(self, kind: str, chunk: int) -> None:
        """Append ``kind`` (F, B or BW) of the next micro-batch on ``chunk``; a B leaves its W pending."""
        key = ("B" if kind == "BW" else kind, chunk)
        i = self.count.get(key, 0)
        self.count[key] = i + 1
        self.actions.append(Action(kind, self.stage[chunk], i))
        if kind == "B":
            self.pending_w.append((chunk, i))

    def overlapped(self, forward_chunk: int) -> None:
        """F&B: the forward of the next micro-batch on ``forward_chunk``, then the full backward of the next
        one on the other chunk, marked as one overlapped pair (``Schedule.overlapped``)."""
        self.pairs.append(len(self.actions))
        self.next("F", forward_chunk), self.next("BW", 1 - forward_chunk)

    def done(self, kind: str, chunk: int) -> int:
        return self.count.get((kind, chunk), 0)

    def oldest_w(self) -> None:
        """The oldest pending weight gradient, if any."""
        if self.pending_w:
            chunk, i = self.pending_w.pop(0)
            self.actions.append(Action("W", self.stage[chunk], i))
            self.count[("W", chunk)] = self.count.get(("W", chunk), 0) + 1


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V on rank r: 2(p-r)-1 forwards on chunk 0; r pairs F(chunk 1) F(chunk 0); p-r triples F B W on
    chunk 1 (the first losses come back); steady F B W on chunk 0 then on chunk 1; cool-down: r pairs of B's,
    p-r times B W on chunk 0, then the W's left (chunk 1's, then chunk 0's). Built for max(m, 2p-1) micro-batches (the warm-up needs 2p-1) and cut back to m."""
    validate("zb-v", p, m, 2)
    n = max(m, 2 * p - 1)
    actions = []
    for r in range(p):
        c = _Counter(p, r)
        for _ in range(2 * (p - r) - 1):
            c.next("F", 0)
        for _ in range(r):
            c.next("F", 1), c.next("F", 0)
        for _ in range(p - r):
            c.next("F", 1), c.next("B", 1), c.oldest_w()
        while c.done("F", 1) < c.done("F", 0) or c.done("F", 0) < n:
            if c.done("F", 0) < n:
                c.next("F", 0)
            c.next("B", 0), c.oldest_w()
            c.next("F", 1), c.next("B", 1), c.oldest_w()
        for _ in range(r):
            c.next("B", 0), c.next("B", 1)
        for _ in range(p - r):
            c.next("B", 0)
            _w_of_chunk(c, 0)
        for chunk in (1, 0):                             # the rest: chunk 1's W's, then chunk 0's
            while any(ch == chunk for ch, _ in c.pending_w):
                _w_of_chunk(c, chunk)
        actions.append([a for a in c.actions if a.microbatch < m])
    return Schedule("zb-v", p, m, 2, actions, placement="v")


def _w_of_chunk(c: _Counter, chunk: int) -> None:
    """The oldest pending W of ``chunk`` (ZB-V's cool-down drains chunk 0's W's beside its B's)."""
    for k, (ch, i) in enumerate(c.pending_w):
        if ch == chunk:
            del c.pending_w[k]
            c.actions.append(Action("W", c.stage[chunk], i))
            return


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV on rank r (chunk 0 = stage r, chunk 1 = stage 2p-1-r; "F&B" = F of one chunk then BW of
    the other, two actions):

    1. 2(p-r-1) forwards on chunk 0;                      2. r+1 pairs F(chunk 0) F(chunk 1);
    3. p-r-1 times B(chunk 1), a pending W, F(chunk 1);   4. m-2p+r+1 times F&B (chunk 0 / 1), F&B (1 / 0);
    5. p-r-1 times BW(chunk 1), F&B (chunk 1 / 0);        6. r+1 times backward chunk 1, backward chunk 0,
       split into B (W left pending) from the middle on;  7. p-r-1 times a pending W, backward chunk 0;
    8. the last r+1 pending W's.
    The last rank's first step-4 pair is not overlapped (F then BW, as the published schedule does)."""
    validate("dualpipev", p, m, 2)
    actions, pairs = [], set()
    for r in range(p):
        c = _Counter(p, r)
        for _ in range(2 * (p - r - 1)):
            c.next("F", 0)
        for _ in range(r + 1):
            c.next("F", 0), c.next("F", 1)
        for _ in range(p - r - 1):
            c.next("B", 1), c.oldest_w(), c.next("F", 1)
        for k in range(m - 2 * p + r + 1):
            if k == 0 and r == p - 1:
                c.next("F", 0), c.next("BW", 1)             # not overlapped: a shorter bubble
            else:
                c.overlapped(0)                             # F&B: forward chunk 0, backward chunk 1
            c.overlapped(1)                                 # F&B: forward chunk 1, backward chunk 0
        for _ in range(p - r - 1):
            c.next("BW", 1)
            c.overlapped(1)
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            c.next("B" if split else "BW", 1)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            c.next("B" if split else "BW", 0)
        for _ in range(p - r - 1):
            c.oldest_w(), c.next("B" if split else "BW", 0)
        while c.pending_w:
            c.oldest_w()
        actions.append(c.actions)
        pairs |= {(r, i) for i in c.pairs}
    return Schedule("dualpipev", p, m, 2, actions, placement="v", overlapped=frozenset(pairs))


def v_min(p: int, m: int) -> Schedule:
    """V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"), built as a repeating block:
    on a clock of chunk slots (F = B = W = 1), micro-batch i runs F on stage s at 6i + s (down and up the V),
    then B on stage s at 6i + 2p + (2p-1-s) (back), and the two W's in the two slots modulo 6 that no other
    action of the rank takes, whichever way round ends the activations' lives sooner. Every rank then does
    one F, B, W per chunk every 6 slots: no bubble in the steady phase, and each activation lives only as
    long as its micro-batch's block — about 2p/3 chunks held per rank, a third of ZB-V's 2p. The price is
    the ramp: one block's span, ≈ 4p slots, is idle per rank (2/3 of 1F1B's). The block's four F/B slots
    differ modulo 6 unless 3 divides p. It is V-Half's building block with its backward passes one slot
    apart instead of two (:func:`minipar.pipeline.vhalf.v_half_block`), repeated without reordering."""
    validate("v-min", p, m, 2)
    return Schedule("v-min", p, m, 2, repeat_block(v_half_block(p, backward_gap=1), p, m).actions, placement="v")

"""What a pipeline schedule is made of, below every schedule and every reader of one: the :class:`Action`, the
:class:`Schedule` (per rank, an ordered list of actions), the one **stage → rank placement** every consumer
reads (:func:`rank_of`, :func:`stages_of`: the runtime, the checker, the lowering into messages, the trace,
the 3D trainer and its byte formulas), what each action waits for (:func:`needs`) and the constraints a
schedule's parameters must meet (:func:`validate`).

The schedules themselves are built in :mod:`minipar.pipeline.schedules` (the loop placement: GPipe, 1F1B,
interleaved, ZB-H1), :mod:`minipar.pipeline.vschedules` and :mod:`minipar.pipeline.vhalf` (the V placement),
which all import this module and nothing of each other.

Placements of ``p · v`` stages on ``p`` ranks:

* ``"loop"`` — stage s on rank ``s % p`` as its chunk ``s // p`` (round robin, *并行策略简介*: 16 layers, 4 ranks,
  v = 2 puts layers 0-1 and 8-9 on rank 0);
* ``"v"`` (v = 2) — rank r holds stages r and 2p-1-r: the model goes down the ranks and back up, so the first
  stage's input and the last stage's loss sit on rank 0 and the turn (stages p-1, p) on rank p-1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..validation import positive_int

__all__ = ["KINDS", "Action", "needs", "made", "Schedule", "PLACEMENTS", "placement_of", "rank_of", "stages_of",
           "NAMES", "V_SCHEDULES", "validate"]

KINDS = ("F", "B", "W", "BW")
V_SCHEDULES = ("zb-v", "dualpipev", "v-min", "v-half")
NAMES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1") + V_SCHEDULES
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Action:
    """One unit of work: ``kind`` of micro-batch ``microbatch`` through model stage ``stage``."""
    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"


def needs(a: Action, last: int):
    """The result (kind, stage, micro-batch) action ``a`` waits for (None: none): F the activation from the
    stage before; B/BW the gradient from the stage after (the last stage: its own F, the loss); W its own B."""
    if a.kind == "F":
        return ("F", a.stage - 1, a.microbatch) if a.stage > 0 else None
    if a.kind in ("B", "BW"):
        return ("B", a.stage + 1, a.microbatch) if a.stage < last else ("F", last, a.microbatch)
    return ("B", a.stage, a.microbatch)


def made(a: Action) -> tuple:
    """The result (kind, stage, micro-batch) action ``a`` produces, in :func:`needs`' terms (a BW is a B)."""
    return ("B" if a.kind == "BW" else a.kind, a.stage, a.microbatch)


def placement_of(name: str) -> str:
    """The placement schedule ``name`` uses: ``"v"`` for the V schedules, ``"loop"`` for the others."""
    return "v" if name in V_SCHEDULES else "loop"


def rank_of(stage: int, p: int, placement: str = "loop") -> int:
    """The pipeline rank (0 … p-1) that holds ``stage``: ``s % p`` (loop), or the V's ``min(s, 2p-1-s)``."""
    if placement == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def stages_of(rank: int, p: int, v: int = 1, placement: str = "loop") -> list:
    """The stages rank ``rank`` of ``p`` holds, chunk 0 first: ``[r, p + r, …]`` (loop), ``[r, 2p-1-r]`` (V)."""
    if placement == "v":
        return [rank, 2 * p - 1 - rank]
    return [c * p + rank for c in range(v)]


@dataclass
class Schedule:
    """``actions[r]`` is rank r's ordered list; ``placement`` (``"loop"`` or ``"v"``) says which rank holds
    which stage (:func:`rank_of`)."""
    name: str
    p: int
    m: int
    v: int
    actions: list
    placement: str = "loop"
    overlapped: frozenset = field(default_factory=frozenset)   # {(rank, i)}: actions i, i+1 are one F&B

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        return rank_of(stage, self.p, self.placement)

    def chunk_of(self, stage: int) -> int:
        return stage // self.p

    def stages_of(self, rank: int) -> list:
        return stages_of(rank, self.p, self.v, self.placement)

    def __str__(self) -> str:
        lines = [f"{self.name} p={self.p} m={self.m} v={self.v}"]
        lines += [f"  rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)]
        return "\n".join(lines)


def validate(name: str, p: int, m: int, v: int = 1, n_layers: int | None = None) -> None:
    """Raise ValueError naming the broken constraint (before any process starts)."""
    if name not in NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(NAMES)}")
    for label, x in (("p (pipeline ranks)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v)):
        positive_int(label, x)
    if name == "naive" and m != 1:
        raise ValueError(f"naive model parallelism sends the whole batch at once: m must be 1, got m={m} "
                         f"(with m > 1 micro-batches use 'gpipe' or '1f1b')")
    if name in ("1f1b", "zb-h1") and m < p:
        raise ValueError(f"minipar's {name} requires at least as many micro-batches as pipeline stages (m >= p), got m={m}, "
                         f"p={p}: with fewer the schedule has no steady phase (Megatron runs it as warm-up and "
                         f"cool-down only); use 'gpipe'")
    if name == "interleaved" and (m < p or m % p):
        raise ValueError(f"interleaved 1F1B sends micro-batches round the ranks in groups of p: m must be a "
                         f"multiple of p, got m={m}, p={p}")
    if name in V_SCHEDULES and v != 2:
        raise ValueError(f"{name} places exactly 2 stages per rank in a V (rank r holds stages r and 2p-1-r): "
                         f"v must be 2, got v={v}")
    if name == "v-min" and p % 3 == 0:
        raise ValueError(f"v-min's repeating block needs p not divisible by 3 (its forward and backward slots "
                         f"would collide modulo 6), got p={p}")
    if name == "dualpipev" and m < 2 * p:
        raise ValueError(f"dualpipev needs at least as many micro-batches as stages (m >= 2p), got m={m}, "
                         f"p={p}: its steady phase pairs the forward of one with the backward of another")
    if name not in ("interleaved", *V_SCHEDULES) and v != 1:
        raise ValueError(f"{name} has one stage per rank: v must be 1, got v={v} (use 'interleaved')")
    if n_layers is not None and n_layers % (p * v):
        cut = f"p = {p}" if v == 1 else f"p·v = {p}·{v} = {p * v} (v: stages per rank)"
        raise ValueError(f"{n_layers} layers cannot be cut into {cut} equal stages: the number of layers must be "
                         f"divisible by {'p' if v == 1 else 'p·v'}")

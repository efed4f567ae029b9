"""Chapter 00 in the tour: every collective, and the hand-written rings, on 4 ranks.

Each row runs one operation through :mod:`minipar.comm` on every rank, then checks what every rank holds
afterwards against the same result computed directly on one process from all ranks' inputs (data movement
must be bit-identical; a sum may differ from the one-process sum by float32 rounding, since the order of
additions differs: tolerance ``SUM_ATOL``). Bytes sent per rank are read from each rank's communication
log and averaged over ranks, next to the formula (:func:`minipar.comm.predicted_bytes_sent`, averaged the
same way). For the ``torch.distributed`` wrappers the log records the traffic of the algorithm it names
(ring or direct); the ``ring`` rows and ``send/recv`` count every message as it is really sent. Beside both,
the bytes each rank really wrote to its sockets (:mod:`minipar.wire`): within gloo's framing (~150 B a
message) of the formula, except where gloo runs another algorithm (:data:`GLOO_ON_THE_WIRE`: reduce-scatter
2x, reduce 1.25x, broadcast a tree), which the rows say.

Ring all-reduce: reduce-scatter then all-gather, 2(N-1)/N · S bytes per rank (Patarasuk & Yuan 2009,
"Bandwidth optimal all-reduce algorithms for clusters of workstations"); ring all-gather and
reduce-scatter: (N-1)/N · S. The root all-reduce (every rank sends its tensor to a root, which sums and
sends the sum back; a parameter server) sends as many bytes in total, but the root alone sends (N-1) · S.

The same pieces drive the chapter 00 notebook and figures: :data:`COLLECTIVES` (what each operation does on
a rank, and what it should give), :func:`run_collectives` (one launch, every operation) and
:func:`busiest_rank_traffic` (ring vs. root as N grows).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from minipar import comm
from minipar.launcher import launch
from minipar.course.tour import WORLD_SIZE, TourRow

from .latency import slowest_rank_fastest, time_small_ring

__all__ = ["Collective", "COLLECTIVES", "ROOT", "rank_input", "run_collectives", "expected_outputs",
           "compare_outputs", "expected_ring_messages", "collectives_on_rank", "busiest_rank_traffic",
           "busiest_rank_rows", "format_busiest", "learner_table", "STRATEGIES"]

ROOT = 0                  # the root of broadcast, scatter, gather, reduce
PAYLOAD_BYTES = 1 << 20   # S in the tour: 1 MiB, a multiple of 4 ranks x 4-byte floats
SUM_ATOL = 1e-5           # float32 sums of 4 N(0,1) values in another order differ by ~1e-7


# ----------------------------------------------------------------------------------------------------
# What each operation does on one rank (x: this rank's input; returns what this rank holds afterwards,
# or None where the operation leaves nothing defined on this rank)
# ----------------------------------------------------------------------------------------------------

def run_broadcast(rank, n, x):
    out = x.clone()  # every rank passes a buffer; the root's content overwrites the others
    comm.broadcast(out, src=ROOT)
    return out


def run_scatter(rank, n, x):
    out = torch.empty(x.numel() // n, dtype=x.dtype)
    comm.scatter(out, list(x.chunk(n)) if rank == ROOT else None, src=ROOT)
    return out


def run_gather(rank, n, x):
    out = [torch.empty_like(x) for _ in range(n)] if rank == ROOT else None
    comm.gather(x, out, dst=ROOT)
    return torch.cat(out) if rank == ROOT else None


def run_reduce(rank, n, x):
    out = x.clone()
    comm.reduce(out, dst=ROOT)
    return out if rank == ROOT else None  # gloo uses the other ranks' buffers as scratch space


def run_all_reduce(rank, n, x):
    out = x.clone()
    comm.all_reduce(out)
    return out


def run_all_gather(rank, n, x):
    out = [torch.empty_like(x) for _ in range(n)]
    comm.all_gather(out, x)
    return torch.cat(out)


def run_reduce_scatter(rank, n, x):
    out = torch.empty(x.numel() // n, dtype=x.dtype)
    comm.reduce_scatter(out, list(x.chunk(n)))
    return out


def run_all_to_all(rank, n, x):
    out = [torch.empty_like(c) for c in x.chunk(n)]
    comm.all_to_all(out, list(x.chunk(n)))
    return torch.cat(out)


def run_send_recv(rank, n, x):
    """Shift around the ring: send to the right neighbour, receive from the left one."""
    out = torch.empty_like(x)
    request = comm.isend(x, dst=(rank + 1) % n)  # post the send first, or every rank waits in recv
    comm.recv(out, src=(rank - 1) % n)
    request.wait()
    return out


def run_ring_all_reduce(rank, n, x):
    return comm.ring_all_reduce(x.clone())


def run_ring_all_gather(rank, n, x):
    return comm.ring_all_gather(x)


def run_ring_reduce_scatter(rank, n, x):
    return comm.ring_reduce_scatter(x)


# ----------------------------------------------------------------------------------------------------
# What each operation should give, computed on one process from every rank's input xs
# ----------------------------------------------------------------------------------------------------

def _total(xs):
    return torch.stack(xs).sum(0)


@dataclass(frozen=True)
class Collective:
    """One operation: ``run(rank, n, x)`` on every rank, ``expected(xs, rank)`` on one process.

    ``piece``: each rank's input is S/N (gather, all-gather) rather than S. ``formula_op``: the row of
    :func:`minipar.comm.predicted_bytes_sent` that predicts its bytes. ``exact``: pure data movement."""
    name: str
    run: Callable
    expected: Callable
    formula_op: str
    exact: bool
    piece: bool = False
    rooted: bool = False

    def formula(self, payload_bytes: int, n: int, rank: int) -> float:
        return comm.predicted_bytes_sent(self.formula_op, payload_bytes, n, self.rooted and rank == ROOT)


_all = [
    Collective("broadcast", run_broadcast, lambda xs, r: xs[ROOT], "broadcast", True, rooted=True),
    Collective("scatter", run_scatter, lambda xs, r: xs[ROOT].chunk(len(xs))[r], "scatter", True, rooted=True),
    Collective("gather", run_gather, lambda xs, r: torch.cat(xs) if r == ROOT else None, "gather", True,
               piece=True, rooted=True),
    Collective("reduce", run_reduce, lambda xs, r: _total(xs) if r == ROOT else None, "reduce", False,
               rooted=True),
    Collective("all_reduce", run_all_reduce, lambda xs, r: _total(xs), "all_reduce", False),
    Collective("all_gather", run_all_gather, lambda xs, r: torch.cat(xs), "all_gather", True, piece=True),
    Collective("reduce_scatter", run_reduce_scatter, lambda xs, r: _total(xs).chunk(len(xs))[r],
               "reduce_scatter", False),
    Collective("all_to_all", run_all_to_all, lambda xs, r: torch.cat([x.chunk(len(xs))[r] for x in xs]),
               "all_to_all", True),
    Collective("send/recv", run_send_recv, lambda xs, r: xs[(r - 1) % len(xs)], "send", True),
    Collective("ring all_reduce", run_ring_all_reduce, lambda xs, r: _total(xs), "all_reduce", False),
    Collective("ring all_gather", run_ring_all_gather, lambda xs, r: torch.cat(xs), "all_gather", True,
               piece=True),
    Collective("ring reduce_scatter", run_ring_reduce_scatter, lambda xs, r: _total(xs).chunk(len(xs))[r],
               "reduce_scatter", False),
]
COLLECTIVES = {c.name: c for c in _all}


def rank_input(rank: int, n: int, name: str, numel: int, values: str = "random") -> torch.Tensor:
    """Rank ``rank``'s input to ``name`` for a payload of ``numel`` float32 elements (numel/N for the
    ``piece`` operations). ``values="random"``: N(0,1) seeded by rank; ``"small"``: 10·rank + 1, 2, ...
    (whole numbers, exact in any order of addition, readable in a diagram)."""
    if numel % n:
        raise ValueError(f"the payload ({numel} elements) must divide evenly over {n} ranks")
    size = numel // n if COLLECTIVES[name].piece else numel
    if values == "small":
        if size > 9:
            raise ValueError(f"'small' values allow at most 9 elements per rank (10·rank + i names the rank), "
                             f"got {size}")
        return 10.0 * rank + torch.arange(1, size + 1, dtype=torch.float32)
    if values == "random":
        return torch.randn(size, generator=torch.Generator().manual_seed(1000 + rank))
    raise ValueError(f"values must be 'random' or 'small', got {values!r}")


# ----------------------------------------------------------------------------------------------------
# Running them, and checking them
# ----------------------------------------------------------------------------------------------------

def collectives_on_rank(rank, n, names, numel, values, keep_inputs=True):
    """What every rank runs: each operation on this rank's input, its bytes read from a communication log."""
    outcome = {}
    for name in names:
        x = rank_input(rank, n, name, numel, values)
        with comm.recording() as log:
            after = COLLECTIVES[name].run(rank, n, x)
        outcome[name] = {"before": x if keep_inputs else None, "after": after, "bytes_sent": log.bytes_sent,
                         "bytes_observed": log.observed_bytes_sent, "calls": log.count()}
    return outcome


def run_collectives(world_size: int = WORLD_SIZE, names=None, numel: int = PAYLOAD_BYTES // 4,
                    values: str = "random", keep_inputs: bool = True) -> dict:
    """Run the named operations (default: all) in one launch; {name: [per rank {before, after,
    bytes_sent}]}, where ``before``/``after`` are the tensors the rank really held (``before`` is None
    unless ``keep_inputs``: the tour regenerates the inputs on one process instead)."""
    names = list(COLLECTIVES) if names is None else list(names)
    unknown = [n for n in names if n not in COLLECTIVES]
    if unknown:
        raise ValueError(f"unknown operations {unknown}; known: {list(COLLECTIVES)}")
    for name in names:  # bad sizes or values fail here, before any process starts
        rank_input(0, world_size, name, numel, values)
    per_rank = launch(collectives_on_rank, world_size, names, numel, values, keep_inputs, quiet=True)
    return {name: [per_rank[r][name] for r in range(world_size)] for name in names}


def expected_outputs(name: str, world_size: int, numel: int, values: str = "random") -> list:
    """What each rank should hold after ``name``, computed on this one process."""
    xs = [rank_input(r, world_size, name, numel, values) for r in range(world_size)]
    return [COLLECTIVES[name].expected(xs, r) for r in range(world_size)]


def compare_outputs(got: list, expected: list) -> float:
    """Max |got - expected| over ranks; inf where a rank holds something of the wrong shape or None."""
    worst = 0.0
    for g, e in zip(got, expected):
        if g is None or e is None:
            if not (g is None and e is None):
                return float("inf")
            continue
        if g.shape != e.shape:
            return float("inf")
        worst = max(worst, (g - e).abs().max().item())
    return worst


def expected_ring_messages(world_size: int, chunk_numel: int = 2) -> list:
    """What each rank sends in each step of :func:`minipar.comm.ring_all_reduce`, worked out on one process,
    when rank q's input is 10·q + 1, 2, …, world_size·chunk_numel: ``[rank][step]`` -> the list of numbers.

    Reduce-scatter step k (k = 0 … N−2): rank r sends chunk (r−k−1) mod N, summed over ranks r, r−1, …, r−k
    (a running sum that has grown by one rank per step). All-gather step k: rank r sends the finished sum, over
    all ranks, of chunk (r−k) mod N."""
    n = world_size
    inputs = [10.0 * q + torch.arange(1, n * chunk_numel + 1) for q in range(n)]
    def summed(ranks, c):
        return sum(inputs[q].chunk(n)[c] for q in ranks).tolist()
    return [[summed([(r - j) % n for j in range(k + 1)], (r - k - 1) % n) for k in range(n - 1)]
            + [summed(range(n), (r - k) % n) for k in range(n - 1)] for r in range(n)]


# Where gloo's own algorithm is not the one the log models, what the wire shows (measured, 4 ranks, 1 MiB):
GLOO_ON_THE_WIRE = {
    "broadcast": "gloo broadcasts along a tree, not from the root alone: observed per rank {per_rank}; "
                 "the mean equals the formula's (root (N-1)·S, others 0) mean",
    "reduce": "gloo's reduce moves more than the direct model (every non-root sends S): observed per rank "
              "{per_rank} — 1.25x in total, the root sends too",
    "reduce_scatter": "gloo has no reduce-scatter of its own: PyTorch's gloo backend all-reduces the whole "
                      "input and keeps one chunk, so the wire carries 2(N-1)/N·S, 2x the ring's (N-1)/N·S "
                      "that the log models; the 'ring reduce_scatter' row sends the textbook amount",
}


def _row(name: str, outcome: list, numel: int) -> TourRow:
    c, n, payload = COLLECTIVES[name], len(outcome), numel * 4
    diff = compare_outputs([o["after"] for o in outcome], expected_outputs(name, n, numel))
    measured = sum(o["bytes_sent"] for o in outcome) / n
    formula = sum(c.formula(payload, n, r) for r in range(n)) / n
    per_rank = [o["bytes_observed"] for o in outcome]
    observed = None if None in per_rank else sum(per_rank) / n
    matches = diff == 0.0 if c.exact else diff <= SUM_ATOL
    counted = name.startswith("ring") or name == "send/recv"
    note = "model: every message counted as sent" if counted else "model: the algorithm the log names"
    if name in GLOO_ON_THE_WIRE:
        note += "; " + GLOO_ON_THE_WIRE[name].format(per_rank=per_rank)
    return TourRow(name, n, matches, diff, measured, formula, None, f"{note}; S = {payload} B; mean over ranks",
                   bytes_observed_per_rank=observed, kind="collective",
                   calls_per_rank=sum(o["calls"] for o in outcome) / n)


GLOO_SHORT = {"broadcast": "gloo: a tree, the root sends 2·S", "reduce": "gloo: the root sends too",
              "reduce_scatter": "gloo: an all-reduce, keep one chunk"}
# The busiest rank's row says what gloo does only where that rank's wire differs from the formula: gloo's reduce
# sends more in total (its root sends too), but its busiest non-root sends the formula's S plus framing.
BUSIEST_NOTES = {name: GLOO_SHORT[name] for name in ("broadcast", "reduce_scatter")}


def learner_table(rows) -> str:
    """The tour's collective rows (:data:`STRATEGIES`) as chapter 00 shows them: per operation whether it equals
    the one-process result, bytes sent per rank (mean over ranks) by the log's model, on the wire and by the
    formula, and — only where the wire differs from the model — what gloo does instead (:data:`GLOO_SHORT`).
    ``format_table`` of :mod:`minipar.course.tour` prints the same rows with every note."""
    from minipar.course.tour import _fmt_bytes, _ratio
    head = ("operation", "equals one process", "model B/rank", "observed", "formula", "observed/formula",
            "what gloo does")
    body = [(r.strategy, "yes" if r.matches else "NO", _fmt_bytes(r.bytes_sent_per_rank),
             _fmt_bytes(r.bytes_observed_per_rank), _fmt_bytes(r.bytes_formula), _ratio(r).replace(" !", ""),
             GLOO_SHORT.get(r.strategy, "")) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(tuple("-" * w for w in widths))] + [line(b) for b in body] + [
        "", f"one call of each on S = {_fmt_bytes(PAYLOAD_BYTES)}, {rows[0].world_size} ranks, mean over ranks; "
        "model: minipar.comm's log; observed: bytes written to the sockets"])


def busiest_rank_rows(world_size: int = WORLD_SIZE, numel: int = PAYLOAD_BYTES // 4) -> list:
    """One launch of every operation; per operation the busiest rank under the formula (the root of a
    broadcast, a non-root of a reduce ...), the formula for that rank (root (N-1)·S for broadcast ...), what its
    sockets really carried (``observed``, None off Linux) and ``model``, the log's count. The log counts
    the messages really sent only for send/recv and the rings built from them (``log_counts_sends``); for a
    torch.distributed collective it records the formula itself (:func:`minipar.comm.predicted_bytes_sent`)."""
    outcomes = run_collectives(world_size, numel=numel, keep_inputs=False)
    rows = []
    for name, outcome in outcomes.items():
        model = [o["bytes_sent"] for o in outcome]
        busiest = max(range(world_size), key=lambda r: (model[r], -r))
        rows.append({"name": name, "matches": _row(name, outcome, numel).matches, "rank": busiest,
                     "model": model[busiest], "formula": COLLECTIVES[name].formula(numel * 4, world_size, busiest),
                     "observed": outcome[busiest]["bytes_observed"], "note": BUSIEST_NOTES.get(name, ""),
                     "log_counts_sends": name == "send/recv" or name.startswith("ring ")})
    return rows


def format_busiest(rows) -> str:
    """The rows of :func:`busiest_rank_rows` as a table: the simplest algorithm's bytes (a model, its formula)
    beside the bytes on the wire."""
    from minipar.course.tour import _fmt_bytes
    lines = [f"{'operation':20} {'same as 1 process':17} {'busiest sender':>14} {'formula':>13} {'on the wire':>11}"
             f"  where gloo differs"]
    for r in rows:
        seen = r["observed"]
        lines.append(f"{r['name']:20} {'yes' if r['matches'] else 'NO':17} {r['rank']:>14} "
                     f"{_fmt_bytes(r['formula']):>13} {_fmt_bytes(seen) if seen is not None else '-':>11}"
                     f"  {r['note']}")
    return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def _tour_rows(numel: int = PAYLOAD_BYTES // 4) -> dict:
    outcomes = run_collectives(WORLD_SIZE, numel=numel, keep_inputs=False)
    return {name: _row(name, outcomes[name], numel) for name in outcomes}


def _tour_entry(name):
    return lambda: _tour_rows()[name]


STRATEGIES = [(name, _tour_entry(name)) for name in COLLECTIVES]


# ----------------------------------------------------------------------------------------------------
# Ring vs. root as N grows (the chapter's measurement of *并行训练*'s claim)
# ----------------------------------------------------------------------------------------------------

def _traffic_on_rank(rank, n, numel):
    x = rank_input(rank, n, "all_reduce", numel)
    sent = {}
    for pattern, fn in (("ring", comm.ring_all_reduce), ("root", comm.root_all_reduce)):
        with comm.recording() as log:
            result = fn(x.clone())
        sent[pattern] = (log.bytes_sent, log.bytes_received, result, log.count("send"))
    sent["small_ring_seconds"] = time_small_ring()   # the latency term: 4 KiB, where bytes cost little
    sent["ring_seconds"] = time_small_ring(numel)      # S itself, which fixes β
    return sent


def busiest_rank_traffic(world_size: int, numel: int) -> dict:
    """All-reduce ``numel`` float32 on ``world_size`` ranks with the ring and through a root; return
    {pattern: {"sent": [bytes per rank], "received": [...], "sends": [messages each rank sent],
    "max_abs_diff": vs. the one-process sum}}, and
    "small_ring_s", "ring_s": the slowest rank's seconds (fastest repeat) for a ring all-reduce of 4 KiB and
    of ``numel`` float32 (:mod:`.latency`)."""
    per_rank = launch(_traffic_on_rank, world_size, numel, quiet=True)
    expected = expected_outputs("all_reduce", world_size, numel)
    out = {}
    for pattern in ("ring", "root"):
        out[pattern] = {"sent": [p[pattern][0] for p in per_rank],
                        "received": [p[pattern][1] for p in per_rank],
                        "sends": [p[pattern][3] for p in per_rank],
                        "max_abs_diff": compare_outputs([p[pattern][2] for p in per_rank], expected)}
    out["small_ring_s"] = slowest_rank_fastest([p["small_ring_seconds"] for p in per_rank])
    out["ring_s"] = slowest_rank_fastest([p["ring_seconds"] for p in per_rank])
    return out

"""Sets of time intervals: their union, intersection and difference, and how long they last.

A replay's compute, hidden, exposed and idle time of a rank are such sets
(:meth:`minipar.machine.replay.ReplayResult.pieces`): the totals are their lengths, and the Gantt chart of a replay
(:func:`minipar.pipeline.gantt.replay_rows`) draws their intervals — one computation for both.

A *set* here is a list of disjoint ``(start, end)`` pairs, ``start < end``, sorted by start; :func:`union`
makes one from any pairs. Intersection and difference sweep both sets once: O(len a + len b).

And the other time a timeline is read for: a **step time**, the slowest rank's time from one step's point to
the next (:func:`slowest_rank_steps`) — of a replay's marks (:meth:`minipar.machine.replay.ReplayResult.step_gaps`) as
of a run's clock at each optimizer step (``python -m minipar bench replay``) — and the events of one step of
a trace, between two of its marks (:func:`step_slice`).
"""
from __future__ import annotations

__all__ = ["union", "intersection", "difference", "length", "slowest_rank_steps", "step_slice"]


def union(intervals) -> list:
    """The set covering what ``intervals`` (any ``(start, end)`` pairs) cover: overlapping or touching ones
    joined, empty ones dropped."""
    out: list = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersection(a: list, b: list) -> list:
    """A ∩ B of two sets."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def difference(a: list, b: list) -> list:
    """A ∖ B of two sets: the parts of ``a`` outside ``b``."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:        # holes wholly before this interval
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:           # holes that cut it
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if end > start:
            out.append((start, end))
    return out


def length(intervals: list) -> float:
    """Σ (end − start): how long a set lasts."""
    return sum(end - start for start, end in intervals)


def slowest_rank_steps(times_per_rank, what: str = "times") -> list:
    """The step times: per step i, ``max_r (t_r[i+1] − t_r[i])`` — a step lasts as long as its slowest rank
    takes from one point to the next. ``times_per_rank``: each rank's time at every step's point (its marks in
    a replay, its clock at each optimizer step in a run); ``what`` names them in errors."""
    gaps = []
    for rank, times in enumerate(times_per_rank):
        if len(times) < 2:
            raise ValueError(f"fewer than two {what} on rank {rank}")
        gaps.append([b - a for a, b in zip(times, times[1:])])
    if len({len(g) for g in gaps}) != 1:
        raise ValueError(f"ranks have a different number of {what}: {[len(g) + 1 for g in gaps]}")
    return [max(step) for step in zip(*gaps)]


def step_slice(events: list, label: str = "step", k: int = -1) -> list:
    """The events strictly between two consecutive marks ``label`` of one rank's events (a
    :class:`minipar.machine.trace.RankTrace`'s): the k-th step counted from 0 (k = 0: between the first two marks),
    or from the end (k = -1, the default: between the last two). ValueError if there is no such step."""
    marks = [i for i, e in enumerate(events) if getattr(e, "kind", None) == "mark" and e.label == label]
    pairs = list(zip(marks, marks[1:]))
    if not -len(pairs) <= k < len(pairs):
        raise ValueError(f"no step {k} between marks {label!r}: {len(marks)} such marks, {len(pairs)} steps")
    first, last = pairs[k]
    return events[first + 1:last]

"""minipar.machine.intervals: sets of intervals by hand, and against a fine grid on random sets; step times."""
import random

import pytest

from minipar.machine.intervals import difference, intersection, length, slowest_rank_steps, step_slice, union
from minipar.machine.trace import Comm, Compute, Mark


def test_union_joins_overlapping_and_touching_and_drops_empty():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5), (6, 5)]) == [(0, 2.5), (3, 4)]
    assert union([]) == [] and length(union([(0, 1), (0, 1)])) == 1


def test_intersection_and_difference_by_hand():
    a, b = [(0, 4), (6, 10)], [(1, 2), (3, 7), (9, 12)]
    assert intersection(a, b) == [(1, 2), (3, 4), (6, 7), (9, 10)]
    assert difference(a, b) == [(0, 1), (2, 3), (7, 9)]
    assert difference(b, a) == [(4, 6), (10, 12)]
    assert difference(a, []) == a and intersection(a, []) == [] and difference([], b) == []


def _grid(sets, step=0.25, top=20):
    """The points k·step + step/2 covered by a set: a brute-force measure."""
    return {k for k in range(int(top / step)) for s, e in sets if s <= k * step + step / 2 < e}


def test_against_a_grid_on_random_sets():
    rng = random.Random(0)
    for _ in range(200):
        starts = [[rng.randint(0, 60) / 4 for _ in range(rng.randint(0, 6))] for _ in range(2)]
        a, b = (union((s, s + rng.randint(0, 8) / 4) for s in side) for side in starts)
        ga, gb = _grid(a), _grid(b)
        assert _grid(intersection(a, b)) == ga & gb and _grid(difference(a, b)) == ga - gb
        assert _grid(union(a + b)) == ga | gb
        assert length(intersection(a, b)) + length(difference(a, b)) == pytest.approx(length(a))
        for got in (intersection(a, b), difference(a, b)):
            assert got == union(got)                 # a set: sorted, disjoint, none empty


def test_slowest_rank_steps_is_per_step_the_slowest_rank():
    # rank 0 steps 1 s then 2 s, rank 1 2 s then 0.5 s: the steps are [2, 2] (each rank's fastest step: 1, 0.5)
    assert slowest_rank_steps([[0, 1, 3], [0, 2, 2.5]]) == [2, 2]
    with pytest.raises(ValueError, match="fewer than two stamps on rank 1"):
        slowest_rank_steps([[0, 1], [0]], what="stamps")
    with pytest.raises(ValueError, match=r"different number of times: \[3, 2\]"):
        slowest_rank_steps([[0, 1, 2], [0, 1]])


def test_step_slice_takes_the_events_between_two_marks():
    setup, a, b, c = Compute(9.0, 9.0), Compute(1.0, 1.0), Comm("all_reduce", (0, 1), 8), Compute(2.0, 2.0)
    events = [setup, Mark("step"), a, b, Mark("other"), Mark("step"), c, Mark("step"), Compute(5.0, 5.0)]
    assert step_slice(events) == [c]                                # the last step by default
    assert step_slice(events, "step", 0) == [a, b, events[4]]       # other labels stay inside
    assert step_slice(events, "step", -2) == step_slice(events, "step", 0)
    for k in (2, -3):
        with pytest.raises(ValueError, match="3 such marks, 2 steps"):
            step_slice(events, "step", k)
    with pytest.raises(ValueError, match="1 such marks, 0 steps"):
        step_slice(events, "other")

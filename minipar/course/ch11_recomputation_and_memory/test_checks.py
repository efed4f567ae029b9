"""Chapter 11 check accepts the cheapest plan that fits and rejects: full recomputation everywhere (fits,
wasteful), a greedy plan that ignores the budget, one that never uses selective recomputation, and one
that returns a plan where none fits instead of raising ValueError."""
import pytest

from minipar.course.checks import ExerciseError
from minipar.course.ch11_recomputation_and_memory import checks as ch11


def place_right(kept, extra, n, budget, modes=("none", "selective", "full"), check_feasible=True):
    if check_feasible and n * kept["full"] > budget:
        raise ValueError("even full recomputation of every block does not fit")
    best = None
    for n_full in range(n + 1):
        for n_sel in range(n - n_full + 1):
            if n_sel and "selective" not in modes:
                continue
            plan = ["full"] * n_full + ["selective"] * n_sel + ["none"] * (n - n_full - n_sel)
            if sum(kept[m] for m in plan) <= budget:
                cost = sum(extra[m] for m in plan)
                if best is None or cost < best[0]:
                    best = (cost, plan)
    return best[1] if best else ["full"] * n


def place_all_full(kept, extra, n, budget):
    if n * kept["full"] > budget:
        raise ValueError
    return ["full"] * n


def place_ignores_budget(kept, extra, n, budget):
    if n * kept["full"] > budget:
        raise ValueError
    return ["none"] * n


def place_no_selective(kept, extra, n, budget):
    return place_right(kept, extra, n, budget, modes=("none", "full"))


def place_never_raises(kept, extra, n, budget):
    return place_right(kept, extra, n, budget, check_feasible=False)


def place_stub(kept, extra, n, budget):
    raise NotImplementedError()


def test_right_passes():
    ch11.check_place_checkpoints(place_right)


@pytest.mark.parametrize("wrong", [place_all_full, place_ignores_budget, place_no_selective, place_never_raises])
def test_wrong_rejected(wrong):
    with pytest.raises(ExerciseError):
        ch11.check_place_checkpoints(wrong)


def test_stub_not_implemented():
    with pytest.raises(NotImplementedError):
        ch11.check_place_checkpoints(place_stub)

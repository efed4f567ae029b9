"""Chapter 06b: its tour rows match one device with observed bytes beside the formula; its checks reject the
stub and plausible wrong answers and accept the solutions; its figure helpers hold what the chapter says."""
import pytest
import torch

from minipar.course.checks import ExerciseError
from minipar.course.ch06b_long_sequences import checks, figures, tour
from minipar.sequence import ring_attention as ra


@pytest.mark.parametrize("name", ["cp-ring", "cp-ring-zigzag", "ulysses"])
def test_tour_rows(name):
    row = dict(tour.STRATEGIES)[name]()
    assert row.strategy == name and row.world_size == 4 and row.matches and row.max_abs_diff < 1e-10
    assert row.bytes_sent_per_rank == pytest.approx(row.bytes_formula)
    if row.bytes_observed_per_rank is not None:   # formula + gloo's framing, said in the note
        assert row.bytes_formula < row.bytes_observed_per_rank < row.bytes_formula * 1.5
        assert "framing" in row.note


# ---- exercise 1: the LSE merge ----

def merge_solution(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse) * o_a + torch.exp(lse_b - lse) * o_b, lse


def merge_stub(o_a, lse_a, o_b, lse_b):
    raise NotImplementedError()


def merge_average(o_a, lse_a, o_b, lse_b):
    return (o_a + o_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_max_lse(o_a, lse_a, o_b, lse_b):
    lse = torch.maximum(lse_a, lse_b)
    return torch.exp(lse_a - lse) * o_a + torch.exp(lse_b - lse) * o_b, lse


def merge_unstable(o_a, lse_a, o_b, lse_b):
    w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)          # overflows for large scores
    return (w_a * o_a + w_b * o_b) / (w_a + w_b), torch.log(w_a + w_b)


def merge_output_only(o_a, lse_a, o_b, lse_b):
    return merge_solution(o_a, lse_a, o_b, lse_b)[0]


def test_lse_merge_check():
    checks.check_lse_merge(merge_solution)
    checks.check_lse_merge(ra.lse_merge)
    with pytest.raises(NotImplementedError):
        checks.check_lse_merge(merge_stub)
    for wrong, says in [(merge_average, "plain average"), (merge_max_lse, "this is max"),
                        (merge_unstable, "overflows"), (merge_output_only, "return both")]:
        with pytest.raises(ExerciseError, match=says):
            checks.check_lse_merge(wrong)


# ---- exercise 2: the zig-zag assignment ----

def zigzag_solution(rank, world_size):
    return [rank, 2 * world_size - 1 - rank]


def zigzag_stub(rank, world_size):
    raise NotImplementedError()


@pytest.mark.parametrize("wrong,says", [
    (lambda r, n: [2 * r, 2 * r + 1], "contiguous"),            # the plain split, in 2N chunks
    (lambda r, n: [r, n + r], "still grows"),                    # striped: unbalanced
    (lambda r, n: [r, 2 * n - r], "one past the end"),           # off by one
    (lambda r, n: [n - 1 - r, n + r], "rank r holds chunks r"),  # balanced, but not the layout the ring uses
])
def test_zigzag_check(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        checks.check_zigzag(wrong)


def test_zigzag_check_accepts_solution_and_rejects_stub():
    checks.check_zigzag(zigzag_solution)
    with pytest.raises(NotImplementedError):
        checks.check_zigzag(zigzag_stub)


def test_schedule_covers_the_causal_triangle_once():
    for zigzag in (False, True):
        blocks = figures.schedule(4, zigzag)
        chunks = 8 if zigzag else 4
        assert set(blocks) == {(q, k) for q in range(chunks) for k in range(q + 1)}
    per_rank = [sum(1 for r, _ in figures.schedule(4, True).values() if r == rank) for rank in range(4)]
    assert per_rank == [9, 9, 9, 9]

"""Chapter 06b: its tour rows match one device with observed bytes beside the formula; its checks reject the
stub and plausible wrong answers and accept the solutions (the LSE merge, zig-zag, the online-softmax forward);
its figure helpers hold what the chapter says."""
import math

import pytest
import torch

from minipar.course.checks import ExerciseError
from minipar.course.ch06b_long_sequences import checks, figures, tour
from minipar.sequence import flash, ring_attention as ra


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


# ---- exercise 3: the online-softmax forward over key blocks ----

def _scores(q, k):
    return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])


def online_solution(q, k, v, block):
    m = l = acc = None
    for j in range(0, k.shape[-2], block):
        s = _scores(q, k[..., j:j + block, :])
        m_new = s.amax(-1) if m is None else torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[..., None])
        if m is None:
            l, acc = p.sum(-1), p @ v[..., j:j + block, :]
        else:
            l = torch.exp(m - m_new) * l + p.sum(-1)
            acc = torch.exp(m - m_new)[..., None] * acc + p @ v[..., j:j + block, :]
        m = m_new
    return acc / l[..., None], m + torch.log(l)


def online_stub(q, k, v, block):
    raise NotImplementedError()


def online_no_rescale(q, k, v, block):       # forgets exp(m − m') on what was accumulated
    m = l = acc = None
    for j in range(0, k.shape[-2], block):
        s = _scores(q, k[..., j:j + block, :])
        m = s.amax(-1) if m is None else torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m[..., None])
        l = p.sum(-1) if l is None else l + p.sum(-1)
        acc = p @ v[..., j:j + block, :] if acc is None else acc + p @ v[..., j:j + block, :]
    return acc / l[..., None], m + torch.log(l)


def online_average(q, k, v, block):          # each block normalised on its own, then averaged
    parts = [ra.block_attention(q, k[..., j:j + block, :], v[..., j:j + block, :]) for j in range(0, k.shape[-2], block)]
    return sum(o for o, _ in parts) / len(parts), torch.logcumsumexp(torch.cat([x for _, x in parts], -1), -1)[..., -1]


def online_lse_without_max(q, k, v, block):
    o, lse = online_solution(q, k, v, block)
    m = _scores(q, k).amax(-1)
    return o, lse - m


def online_no_max(q, k, v, block):           # exp(s) itself: overflows float32 for large scores
    l = acc = 0
    for j in range(0, k.shape[-2], block):
        p = torch.exp(_scores(q, k[..., j:j + block, :]))
        l, acc = l + p.sum(-1), acc + p @ v[..., j:j + block, :]
    return acc / l[..., None], torch.log(l)


def online_all_scores(q, k, v, block):       # right numbers, but a whole row of scores at once
    o, lse = ra.block_attention(q, k, v)
    return o, lse[..., 0]


def online_keepdim_lse(q, k, v, block):
    o, lse = online_solution(q, k, v, block)
    return o, lse[..., None]


def test_online_softmax_check_accepts_solutions_and_rejects_stub():
    checks.check_online_softmax(online_solution)
    checks.check_online_softmax(lambda q, k, v, block: flash.flash_forward(q, k, v, block_q=None, block_k=block))
    with pytest.raises(NotImplementedError):
        checks.check_online_softmax(online_stub)


@pytest.mark.parametrize("wrong,says", [
    (online_no_rescale, "multiplied by exp"),
    (online_average, "multiplied by exp"),
    (online_lse_without_max, "must be added back"),
    (online_no_max, "overflows float32"),
    (online_all_scores, "never to hold a row of scores"),
    (online_keepdim_lse, "no trailing 1"),
    (lambda q, k, v, block: online_solution(q, k, v, block)[0], "return the normalised output"),
])
def test_online_softmax_check_rejects_plausible_wrong_answers(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        checks.check_online_softmax(wrong)


def test_load_balance_figure_counts_half_size_chunk_pairs():
    data = {"ring": ([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0]), "ring-zigzag": ([9, 9, 9, 9], [2.0] * 4)}
    units = figures.counted_work(data)
    assert units == {"ring": [4, 8, 12, 16], "ring-zigzag": [9, 9, 9, 9]}
    assert max(units["ring"]) * 9 == max(units["ring-zigzag"]) * 16          # the 16/9 the chapter marks
    fig = figures.draw_load_balance(data)
    ax = fig.axes[0]
    assert "16/9" in " ".join(ax.get_legend_handles_labels()[1]) and ax.get_title()
    heights = [p.get_height() for p in ax.patches]
    assert max(heights) == pytest.approx(4.0 / 2.0)                         # ÷ zig-zag's busiest rank

"""Chapter 13 checks: each accepts the fix, rejects the broken program and a plausible wrong fix with the
message that names the mistake, and leaves the unsolved stub a NotImplementedError."""
import multiprocessing

import pytest
import torch

from minipar import comm
from minipar.course.checks import ExerciseError
from minipar.course.ch13_when_it_goes_wrong import checks as ch13


# 1. the hang ---------------------------------------------------------------------------------------------

def clipped_right(grad, world_size, max_norm):
    comm.all_reduce(grad)
    grad /= world_size
    norm = grad.norm()
    return grad * (max_norm / norm) if norm > max_norm else grad


def clipped_broken(grad, world_size, max_norm):        # the exercise's program: only large gradients sync
    if grad.norm() > max_norm:
        comm.all_reduce(grad)
        grad /= world_size
    return grad


def clipped_locally(grad, world_size, max_norm):       # no hang, but each rank clips its own
    norm = grad.norm()
    if norm > max_norm:
        grad = grad * (max_norm / norm)
    comm.all_reduce(grad)
    return grad / world_size


def clipped_stub(grad, world_size, max_norm):
    raise NotImplementedError()


def test_clipped_average_accepts_the_fix(capsys):
    ch13.check_clipped_average(clipped_right)
    assert "every rank" in capsys.readouterr().out


def test_clipped_average_names_the_hang_with_the_flight_recorder(no_leftover_processes):
    with pytest.raises(ExerciseError, match="never issued call #1") as caught:
        ch13.check_clipped_average(clipped_broken)
    assert "every rank must make every call" in str(caught.value)
    assert multiprocessing.active_children() == []


def test_clipped_average_rejects_local_clipping():
    with pytest.raises(ExerciseError, match="clipped its own gradient"):
        ch13.check_clipped_average(clipped_locally)


def test_clipped_average_stub_is_not_implemented():
    with pytest.raises(NotImplementedError):
        ch13.check_clipped_average(clipped_stub)


# 2. the silent gradient bug -------------------------------------------------------------------------------

def average_right(params, world_size):
    for p in params:
        comm.all_reduce(p.grad)
        p.grad /= world_size


def average_broken(params, world_size):              # the exercise's program: biases summed, not averaged
    for p in params:
        comm.all_reduce(p.grad)
        if p.dim() > 1:
            p.grad /= world_size


def average_summed(params, world_size):
    for p in params:
        comm.all_reduce(p.grad)


def average_stub(params, world_size):
    raise NotImplementedError()


def test_average_gradients_accepts_the_fix(capsys):
    ch13.check_average_gradients(average_right)
    assert "equal one device" in capsys.readouterr().out


def test_average_gradients_search_finds_the_broken_program_to_the_biases():
    with pytest.raises(ExerciseError, match="only the biases depart") as caught:
        ch13.check_average_gradients(average_broken)
    assert "first departure: step 0" in str(caught.value)


def test_average_gradients_rejects_a_sum():
    with pytest.raises(ExerciseError, match="then divide by world_size"):
        ch13.check_average_gradients(average_summed)


def test_average_gradients_stub_is_not_implemented():
    with pytest.raises(NotImplementedError):
        ch13.check_average_gradients(average_stub)


# 3. the seed bug ------------------------------------------------------------------------------------------

def seeds_right(seed, tp_rank):
    return seed, seed + 2718 + tp_rank


def seeds_broken(seed, tp_rank):                       # the exercise's program: one per-rank seed for both
    return seed + tp_rank, seed + tp_rank


def seeds_one(seed, tp_rank):                          # the same seed everywhere: split masks repeat
    return seed, seed


def seeds_no_offset(seed, tp_rank):
    return seed, seed + tp_rank


def seeds_stub(seed, tp_rank):
    raise NotImplementedError()


def test_dropout_seeds_accepts_megatron_s_rule(capsys):
    ch13.check_dropout_seeds(seeds_right)
    assert "distinct split seeds" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [(seeds_broken, "no tp_rank in the replicated seed"),
                                            (seeds_one, "add tp_rank to the split seed"),
                                            (seeds_no_offset, "offset the split seeds")])
def test_dropout_seeds_rejects_the_wrong_rules(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ch13.check_dropout_seeds(wrong)


def test_dropout_seeds_stub_is_not_implemented():
    with pytest.raises(NotImplementedError):
        ch13.check_dropout_seeds(seeds_stub)


def test_the_expected_average_is_clipped():
    mean = sum(ch13.grads_of(r) for r in range(3)) / 3
    assert float(mean.norm()) > ch13.MAX_NORM                     # the exercise's average needs clipping
    assert torch.allclose(ch13.expected_clipped_average(3), mean / float(mean.norm()))


# 4. ULP distance ------------------------------------------------------------------------------------------

def ulp_right(a, b):
    def ordered(t):
        bits = t.view(torch.int32).long()
        return torch.where(bits < 0, -2 ** 31 - bits, bits)
    return (ordered(a) - ordered(b)).abs()


def ulp_raw_bits(a, b):                                  # no ordering of the negative floats
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def ulp_in_epsilons(a, b):                               # |Δ| in units of ε, rounded to an integer
    return ((a.double() - b.double()).abs() / torch.finfo(torch.float32).eps).round().long()


def ulp_abs_difference(a, b):
    return (a - b).abs()


def ulp_stub(a, b):
    raise NotImplementedError()


def test_ulp_distance_accepts_the_right_answer(capsys):
    ch13.check_ulp_distance(ulp_right)
    assert "right on all" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, words", [(ulp_raw_bits, "sign bit"), (ulp_in_epsilons, "twice as dense"),
                                          (ulp_abs_difference, "a float came back")])
def test_ulp_distance_names_each_plausible_mistake(wrong, words):
    with pytest.raises(ExerciseError, match=words):
        ch13.check_ulp_distance(wrong)


def test_ulp_distance_stub_stays_not_implemented():
    with pytest.raises(NotImplementedError):
        ch13.check_ulp_distance(ulp_stub)

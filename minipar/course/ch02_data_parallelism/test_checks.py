"""Chapter 02 checks: each accepts the right answer, rejects the plausible wrong ones kept here with the
message that names the mistake, and leaves the unsolved stub a NotImplementedError."""
import pytest
import torch

from minipar import comm
from minipar.course.checks import ExerciseError
from minipar.course.ch02_data_parallelism import checks as ch02


# 1. the gradient hook -----------------------------------------------------------------------------

def hook_right(world_size):
    def hook(p):
        comm.all_reduce(p.grad)
        p.grad.div_(world_size)
    return hook


def hook_sum_only(world_size):
    return lambda p: comm.all_reduce(p.grad)


def hook_divided_twice(world_size):
    def hook(p):
        p.grad.div_(world_size)
        comm.all_reduce(p.grad)
        p.grad.div_(world_size)
    return hook


def hook_local_only(world_size):
    return lambda p: p.grad.div_(world_size)


def hook_reduces_weights(world_size):
    def hook(p):
        with torch.no_grad():
            comm.all_reduce(p.data)
            p.data.div_(world_size)
    return hook


def hook_reduces_a_copy(world_size):
    def hook(p):
        g = p.grad.clone()
        comm.all_reduce(g)
        p.grad = p.grad / world_size
    return hook


# 2. the bucketed all-reduce -----------------------------------------------------------------------

def _pack(tensors, bucket_bytes):
    buckets, current, size = [], [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(t)
        size += n
    return buckets + ([current] if current else [])


def buckets_right(tensors, bucket_bytes):
    for bucket in _pack(tensors, bucket_bytes):
        flat = comm.all_reduce(torch.cat([t.reshape(-1) for t in bucket]))
        offset = 0
        for t in bucket:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


def buckets_none(tensors, bucket_bytes):
    for t in tensors:
        comm.all_reduce(t)


def buckets_not_copied_back(tensors, bucket_bytes):
    for bucket in _pack(tensors, bucket_bytes):
        comm.all_reduce(torch.cat([t.reshape(-1) for t in bucket]))


def buckets_wrong_offsets(tensors, bucket_bytes):
    for bucket in _pack(tensors, bucket_bytes):
        flat = comm.all_reduce(torch.cat([t.reshape(-1) for t in bucket]))
        for t in bucket:                       # every tensor unpacked from the start of the bucket
            t.copy_(flat[: t.numel()].view_as(t))


def buckets_one_big(tensors, bucket_bytes):
    buckets_right(tensors, 10**9)


# 3. the sampler's sharding ----------------------------------------------------------------------------

def shard_right(length, n, rank):
    per = -(-length // n)
    order = list(range(length))
    while len(order) < per * n:
        order += order[: per * n - len(order)]
    return order[rank::n]


def shard_no_padding(length, n, rank):
    return list(range(length))[rank::n]


def shard_contiguous(length, n, rank):
    per = -(-length // n)
    order = list(range(length))
    while len(order) < per * n:
        order += order[: per * n - len(order)]
    return order[rank * per:(rank + 1) * per]


def shard_drop_last(length, n, rank):
    per = length // n
    return list(range(per * n))[rank::n] if per else list(range(length))[rank::n]


def shard_pad_with_last(length, n, rank):
    per = -(-length // n)
    order = list(range(length)) + [length - 1] * (per * n - length)
    return order[rank::n]


@pytest.mark.parametrize("check, right", [
    (ch02.check_average_hook, hook_right),
    (ch02.check_bucketed_all_reduce, buckets_right),
    (ch02.check_shard_indices, shard_right),
])
def test_checks_accept_the_right_answer(check, right, capsys):
    check(right)
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("check, wrong, message", [
    (ch02.check_average_hook, hook_sum_only, "divide by world_size"),
    (ch02.check_average_hook, hook_divided_twice, "divided twice"),
    (ch02.check_average_hook, hook_local_only, "no comm.all_reduce was called"),
    (ch02.check_average_hook, hook_reduces_weights, "param.data"),
    (ch02.check_average_hook, hook_reduces_a_copy, "not on param.grad itself"),
    (ch02.check_bucketed_all_reduce, buckets_none, "no bucketing"),
    (ch02.check_bucketed_all_reduce, buckets_not_copied_back, "never copied back"),
    (ch02.check_bucketed_all_reduce, buckets_wrong_offsets, "offsets are off"),
    (ch02.check_bucketed_all_reduce, buckets_one_big, "greedy packing"),
    (ch02.check_shard_indices, shard_no_padding, "different numbers of examples"),
    (ch02.check_shard_indices, shard_contiguous, "not a contiguous block"),
    (ch02.check_shard_indices, shard_drop_last, "drop_last"),
    (ch02.check_shard_indices, shard_pad_with_last, "FIRST indices"),
])
def test_checks_reject_the_wrong_answer(check, wrong, message):
    with pytest.raises(ExerciseError, match=message):
        check(wrong)


def test_the_stubs_stay_not_implemented():
    def stub_factory(world_size):
        def hook(p):
            raise NotImplementedError()
        return hook

    def stub(*args):
        raise NotImplementedError()
    for check, fn in ((ch02.check_average_hook, stub_factory), (ch02.check_bucketed_all_reduce, stub),
                      (ch02.check_shard_indices, stub)):
        with pytest.raises(NotImplementedError):
            check(fn)

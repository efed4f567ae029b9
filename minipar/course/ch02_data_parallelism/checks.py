"""Checks for chapter 02's exercises: a DDP gradient hook that averages, a bucketed all-reduce, and the
distributed sampler's sharding.

The distributed checks run the learner's code on 4 ranks and compare with one device (the hook), with a
real per-tensor all-reduce (the buckets) or with :class:`minipar.data.sampler.DistributedSampler` (the
sharding, which equals torch's), and name the likely mistake when the answer matches a known wrong one.
"""
from __future__ import annotations

import torch

from minipar import comm
from minipar.course.checks import fail, run_on_ranks

__all__ = ["check_average_hook", "check_bucketed_all_reduce", "check_shard_indices", "expected_buckets"]

WORLD_SIZE = 4


# ----------------------------------------------------------------------------------------------------
# 1. The DDP gradient hook
# ----------------------------------------------------------------------------------------------------

def _hook_problem():
    from minipar.datasets import regression_batches
    from minipar.models import MLP
    (x, y), = regression_batches(8, 6, 3, 1, seed=2)
    return (lambda: MLP((6, 16, 3), seed=1)), x, y


def _reference_grads():
    make, x, y = _hook_problem()
    model = make()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _run_hook(rank, world_size, make_hook):
    from minipar.loop import shard_batch
    make, x, y = _hook_problem()
    model = make()
    x, y = shard_batch((x, y), rank, world_size)
    alone = make()  # this rank's own gradient, for the diagnosis
    torch.nn.functional.mse_loss(alone(x), y).backward()
    local = {n: p.grad for n, p in alone.named_parameters()}
    hook = make_hook(world_size)
    for p in model.parameters():
        # (torch insists such a hook returns None; a returned value is harmless here, so drop it)
        p.register_post_accumulate_grad_hook(lambda param: None if hook(param) is None else None)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with comm.recording() as log:
        torch.nn.functional.mse_loss(model(x), y).backward()
    weights_changed = any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    return ({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            log.count("all_reduce"), weights_changed, local)


def check_average_hook(make_hook) -> None:
    """``make_hook(world_size)`` -> ``hook(param)`` for ``register_post_accumulate_grad_hook``: after
    backward every rank's ``param.grad`` must be the gradient of the whole batch (the mean over ranks)."""
    want = _reference_grads()
    results = run_on_ranks(_run_hook, WORLD_SIZE, make_hook, what="your gradient hook")
    n_params = len(want)
    for rank, (grads, all_reduces, weights_changed, local) in enumerate(results):
        if weights_changed:
            fail(f"rank {rank}: the weights", "unchanged by backward (the optimizer changes them, later)",
                 "changed", "the hook reduced param.data (the weights) instead of param.grad")
        for name, w in want.items():
            got = grads[name]
            if got is not None and torch.allclose(got, w, atol=1e-6, rtol=1e-5):
                continue
            if got is None:
                fail(f"rank {rank}: {name}.grad", "a tensor", None, "the hook set param.grad to None")
            if torch.allclose(got, w * WORLD_SIZE, atol=1e-6, rtol=1e-5):
                fail(f"rank {rank}: {name}.grad", "the mean over ranks", f"{WORLD_SIZE}x the mean (the sum)",
                     "all_reduce sums: divide by world_size after it")
            if torch.allclose(got, w / WORLD_SIZE, atol=1e-6, rtol=1e-5):
                fail(f"rank {rank}: {name}.grad", "the mean over ranks", f"1/{WORLD_SIZE} of the mean",
                     "divided twice (before and after the all-reduce?), or by world_size squared")
            if all_reduces == 0:
                fail(f"rank {rank}: {name}.grad", "the mean over ranks", "this rank's own gradient",
                     "no comm.all_reduce was called (use minipar.comm, not torch.distributed, so it is logged)")
            if any(torch.allclose(got, local[name] * k, atol=1e-7) for k in (1, 1 / WORLD_SIZE)):
                fail(f"rank {rank}: {name}.grad", "the mean over ranks", "this rank's own gradient (scaled?)",
                     "the all-reduce ran, but not on param.grad itself: on param.data (the weights, equal on "
                     "every rank, so nothing visible changed) or on a copy such as param.grad.clone()")
            fail(f"rank {rank}: {name}.grad", "the full-batch gradient", "something else",
                 "all-reduce param.grad in place (comm.all_reduce(param.grad)), then divide it by world_size")
        if all_reduces != n_params:
            fail(f"rank {rank}: all-reduce calls in one backward", n_params, all_reduces,
                 "one all-reduce per parameter, in the hook")
    print(f"gradient hook: every rank holds the full-batch gradient of all {n_params} parameters after "
          f"backward ({n_params} all-reduces per rank)")


# ----------------------------------------------------------------------------------------------------
# 2. A bucketed all-reduce
# ----------------------------------------------------------------------------------------------------

def expected_buckets(sizes_bytes: list, bucket_bytes: int) -> list:
    """Greedy packing in order: a tensor starts a new bucket when it would overflow the current one."""
    buckets, current = [], 0
    for s in sizes_bytes:
        if current and current + s > bucket_bytes:
            buckets.append(current)
            current = 0
        current += s
    return buckets + ([current] if current else [])


SHAPES = [(5,), (3, 4), (7,), (2, 2), (16,), (1,), (6, 3)]
BUCKET_BYTES = 64


def _rank_tensors(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _run_buckets(rank, world_size, bucketed_all_reduce):
    tensors = _rank_tensors(rank)
    with comm.recording() as log:
        bucketed_all_reduce(tensors, BUCKET_BYTES)
    payloads = [r.payload_bytes for r in log.records if r.op == "all_reduce"]
    return tensors, payloads


def check_bucketed_all_reduce(bucketed_all_reduce) -> None:
    """``bucketed_all_reduce(tensors, bucket_bytes)`` sums every tensor over the ranks, in place, with one
    all-reduce per bucket of consecutive tensors (greedy, at most ``bucket_bytes`` unless one tensor is
    larger)."""
    want = [sum(_rank_tensors(r)[i] for r in range(WORLD_SIZE)) for i in range(len(SHAPES))]
    sizes = [torch.Size(s).numel() * 4 for s in SHAPES]
    buckets = expected_buckets(sizes, BUCKET_BYTES)
    results = run_on_ranks(_run_buckets, WORLD_SIZE, bucketed_all_reduce, what="bucketed_all_reduce")
    for rank, (tensors, payloads) in enumerate(results):
        for i, (got, w) in enumerate(zip(tensors, want)):
            if torch.allclose(got, w, atol=1e-5):
                continue
            if torch.allclose(got, _rank_tensors(rank)[i]):
                fail(f"rank {rank}: tensor {i} after the call", "the sum over ranks, written back in place",
                     "unchanged", "the bucket was reduced but never copied back into the tensors")
            if torch.allclose(got, w / WORLD_SIZE, atol=1e-5):
                fail(f"rank {rank}: tensor {i}", "the sum over ranks", "the mean",
                     "this exercise sums (averaging is the hook's job): do not divide")
            fail(f"rank {rank}: tensor {i} (shape {SHAPES[i]})", w.flatten()[:4].tolist(),
                 got.flatten()[:4].tolist(), "offsets are off: tensor i occupies the next numel() elements "
                 "of the bucket, in order, when packing and when unpacking")
        if payloads == sizes:
            fail(f"rank {rank}: all-reduce calls", f"{len(buckets)} (buckets of bytes {buckets})",
                 f"{len(payloads)}, one per tensor", "no bucketing: pack consecutive tensors into one flat "
                 "buffer (torch.cat of t.reshape(-1)) and all-reduce the buffer")
        if payloads != buckets:
            fail(f"rank {rank}: all-reduce payloads (bytes)", buckets, payloads,
                 f"greedy packing in order: start a new bucket when the next tensor would take it past "
                 f"{BUCKET_BYTES} bytes")
    print(f"bucketed all-reduce: {len(SHAPES)} tensors summed over {WORLD_SIZE} ranks in {len(buckets)} "
          f"all-reduces of {buckets} bytes")


# ----------------------------------------------------------------------------------------------------
# 3. The sampler's sharding
# ----------------------------------------------------------------------------------------------------

CASES = [(12, 4), (10, 4), (13, 4), (3, 4), (1, 3), (7, 2), (9, 3)]


def check_shard_indices(shard_indices) -> None:
    """``shard_indices(length, world_size, rank)`` -> rank's indices, no shuffling: the epoch padded to a
    multiple of world_size by repeating its first indices, then dealt round-robin."""
    from minipar.data.sampler import DistributedSampler
    for length, n in CASES:
        shards = [list(DistributedSampler(length, n, r, shuffle=False)) for r in range(n)]
        got = [shard_indices(length, n, r) for r in range(n)]
        got = [list(g) if g is not None else None for g in got]
        for r in range(n):
            if got[r] == shards[r]:
                continue
            where = f"shard_indices({length}, {n}, {r})"
            lengths = {len(g) for g in got if g is not None}
            if len(lengths) > 1:
                fail(where, shards[r], got[r], "ranks get different numbers of examples: the rank with fewer "
                     "steps would leave the others waiting in an all-reduce forever. Pad the epoch to "
                     "world_size · ceil(length / world_size) indices")
            if sorted(i for g in got for i in g) == sorted(i for s in shards for i in s):
                fail(where, shards[r], got[r], "the right indices, dealt the wrong way: rank r takes every "
                     "world_size-th index starting at r (order[r::world_size]), not a contiguous block")
            if len(got[r]) < len(shards[r]):
                fail(where, shards[r], got[r], "the tail was dropped (that is drop_last=True): pad by "
                     "repeating the first indices instead")
            fail(where, shards[r], got[r], "pad with the FIRST indices of the epoch (0, 1, ...), repeated as "
                 "often as needed, then deal round-robin")
    print(f"shard_indices: equals DistributedSampler(shuffle=False) (and torch's) on {len(CASES)} cases")

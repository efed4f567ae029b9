"""The distributed sampler: torch's indices exactly, a partition of each (padded) epoch, and training on its
shards equals one device on the union of the shards (float32 tolerance of minipar.check)."""
import pytest
import torch
import torch.utils.data as tud

from minipar.check import Recipe, check_equivalence, RunResult
from minipar.data import ddp
from minipar.data.sampler import DistributedSampler
from minipar.loop import shard_batch
from minipar.models import MLP


@pytest.mark.parametrize("length", [12, 13, 3, 1])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_indices_as_torch(length, shuffle, drop_last):
    n = 4
    if drop_last and length < n:
        with pytest.raises(ValueError):
            DistributedSampler(length, n, 0, drop_last=True)
        return
    for epoch in (0, 3):
        for rank in range(n):
            ours = DistributedSampler(length, n, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            theirs = tud.DistributedSampler(range(length), n, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            ours.set_epoch(epoch), theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_padding_rule_and_partition():
    n, length = 4, 10                                  # ceil(10/4) = 3 per rank: 12 indices, 2 repeated
    shards = [list(DistributedSampler(length, n, r, shuffle=False)) for r in range(n)]
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    flat = sorted(i for s in shards for i in s)
    assert flat == sorted(list(range(10)) + [0, 1])    # every example once, the first two twice
    assert shards[0] == [0, 4, 8] and shards[2] == [2, 6, 0]
    dropped = [list(DistributedSampler(length, n, r, shuffle=False, drop_last=True)) for r in range(n)]
    assert sorted(i for s in dropped for i in s) == list(range(8))


def test_epochs_reshuffle_identically_on_every_rank():
    a, b = DistributedSampler(16, 2, 0, seed=1), DistributedSampler(16, 2, 1, seed=1)
    first = list(a) + list(b)
    a.set_epoch(1), b.set_epoch(1)
    second = list(a) + list(b)
    assert sorted(first) == sorted(second) == list(range(16)) and first != second


def test_shard_batch_rejects_uneven_batches():
    x = torch.arange(10).view(10, 1)
    assert shard_batch(x, 1, 2).flatten().tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_batch(x, 0, 4)


LENGTH, PER_RANK, RANKS = 38, 2, 4                      # 38 examples: padded to 40, 5 steps of 8


def _dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(LENGTH, 6, generator=g)
    return x, torch.tanh(x @ torch.randn(6, 3, generator=g))


def _global_batches():
    """What one device trains on: the sampler's epoch order (padded), B = PER_RANK x RANKS per step."""
    x, y = _dataset()
    order = DistributedSampler(LENGTH, RANKS, 0, seed=3).epoch_order()
    b = PER_RANK * RANKS
    return [(x[order[i:i + b]], y[order[i:i + b]]) for i in range(0, len(order), b)]


def _train_from_sampler(rank, world_size, recipe):
    """Each rank reads only its own indices from the sampler, never the global batch."""
    x, y = _dataset()
    mine = list(DistributedSampler(LENGTH, world_size, rank, seed=3))
    model = ddp.DistributedDataParallel(recipe.model())
    opt = recipe.optimizer(model.parameters())
    losses = []
    for i in range(0, len(mine), PER_RANK):
        idx = mine[i:i + PER_RANK]
        opt.zero_grad(set_to_none=True)
        loss = recipe.loss(model, x[idx], y[idx])
        loss.backward()
        opt.step()
        losses.append(ddp.comm.all_reduce(loss.detach().clone()).item() / world_size)
    return RunResult(losses, {n: p.detach().clone() for n, p in model.module.named_parameters()})


def test_training_on_sampler_shards_equals_one_device_on_the_padded_epoch():
    recipe = Recipe(lambda: MLP((6, 16, 3), seed=0), _global_batches())
    assert recipe.steps == 5
    check_equivalence(_train_from_sampler, RANKS, recipe, launch_kwargs=dict(quiet=True)).assert_ok()

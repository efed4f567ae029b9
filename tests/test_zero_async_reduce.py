"""ZeRO-2/3 with asynchronous reduce-scatters (issue 39: what PyTorch's FSDP does): each unit's reduce-scatter is
posted when its backward ends and taken only before the optimizer step — equal to one device, the same bytes as
the blocking version, and the backward did not wait for them (observed: when the backward returns, every block's
reduce-scatter has been posted and none waited for — the root, whose inputs need no gradient, posts its own when
the step begins; the blocking version has none outstanding). Whether the transfers really ran under the compute
is a question for a trace, not for this test."""
import pytest
import torch

from minipar import comm
from minipar.check import RunResult, compare, gpt_recipe, train_reference
from minipar.data.zero import ZeRO, block_units
from minipar.launcher import launch
from minipar.loop import mean_over_ranks, shard_batch


def recipe():
    r = gpt_recipe(steps=3, batch_size=8, seq_len=16)
    r.dtype = torch.float64
    return r


def _train(rank, world_size, recipe, stage, async_reduce):
    model = recipe.model().to(recipe.dtype)
    zero = ZeRO(model, recipe.optimizer, stage, None, block_units(model), async_reduce=async_reduce)
    losses, pending_after_backward = [], []
    with comm.recording() as log:
        for batch in recipe.batches:
            x, y = shard_batch(batch, rank, world_size)
            zero.zero_grad()
            loss = recipe.loss(model, x, y)
            loss.backward()
            pending_after_backward.append(sum(u.pending is not None for u in zero.units))
            zero.step()
            assert all(u.pending is None for u in zero.units)        # taken before the optimizer ran
            losses.append(mean_over_ranks(loss.detach()))
    return RunResult(losses, zero.full_parameters()), log.bytes_sent, pending_after_backward, len(zero.units)


@pytest.mark.parametrize("stage", [2, 3])
def test_async_reduce_scatter_equals_one_device_with_the_same_bytes(stage):
    r = recipe()
    ref = train_reference(r)
    blocking = launch(_train, 4, r, stage, False, quiet=True)
    posted = launch(_train, 4, r, stage, True, quiet=True)
    compare(ref, [o[0] for o in posted], dtype=torch.float64).assert_ok()
    assert [o[1] for o in posted] == [o[1] for o in blocking]                 # the same collectives, same bytes
    for _, _, pending, units in posted:          # every block's still in flight (the root's is posted by step) ...
        assert pending == [units - 1] * r.steps
    assert all(p == [0] * r.steps for _, _, p, _ in blocking)                # ... where blocking ones are done

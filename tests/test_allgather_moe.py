"""The all-gather token dispatcher (minipar.moe.allgather) against one device: training in float64 (ep 4; ep 2 ×
dp 2, top-2), the planted worst case (every token to one expert) with nothing dropped, and its bytes per step
from the log against 4·(ep−1)·T·M·b + the gates' and ids' terms, whatever the routing."""
import pytest
import torch

from minipar import comm, launch
from minipar.check import compare, train_reference
from minipar.moe import allgather
from minipar.moe import expert_parallel as epm
from minipar.moe.layer import moe_recipe

F64 = torch.float64


@pytest.mark.parametrize("world_size,ep,k", [(4, 4, 1), (4, 2, 2)])
def test_training_equals_one_device(world_size, ep, k):
    recipe = moe_recipe(steps=3, batch_size=8, dtype=F64, experts=4, k=k, dropless=True)
    c = compare(train_reference(recipe), allgather.run(recipe, world_size=world_size, ep=ep), dtype=F64)
    c.assert_ok()


def _logged(rank, world_size, recipe, ep):
    log, routings = comm.CommLog(), []
    result = allgather.parallel_train(rank, world_size, recipe, ep=ep, step_log=log, routings=routings)
    ep_log = log.select(dims=("ep",))
    moved = sum(r.sent_bytes for r in ep_log.records if r.op in ("all_gather", "reduce_scatter"))
    return result, routings, moved / recipe.steps


def test_planted_worst_case_drops_nothing_and_bytes_do_not_depend_on_routing():
    from test_dropless_moe import _planted
    recipe = _planted(True)
    reference, _ = epm.loss_free_reference(recipe)
    out = launch(_logged, 4, recipe, 4, quiet=True)
    compare(reference, [o[0] for o in out], dtype=F64).assert_ok()
    assert all(d == 0 for _, routings, _ in out for layers in routings for _, d in layers)
    t, width, layers = 32, recipe.model().cfg.n_embd, len(recipe.model().moe_layers())
    want = layers * allgather.predicted_bytes(t, width, k=1, experts=4, ep=4, element_size=8)["allgather"]
    assert all(o[2] == want for o in out), [o[2] for o in out]       # every rank alike, imbalance or not

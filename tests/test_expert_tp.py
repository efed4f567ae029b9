"""Expert-TP (minipar.moe.expert_tp): every expert's FFN split over tp ranks, beside EP, against one device in
float64 (ep 2 × tp 2; tp 2 × dp 2, top-2), its tp exchanges' bytes from the log, and bad layouts refused."""
import pytest
import torch

from minipar import comm, launch
from minipar.check import compare, train_reference
from minipar.moe import expert_tp
from minipar.moe.layer import moe_recipe, no_drop_capacity_factor

F64 = torch.float64


def _recipe(k=1, experts=4):
    return moe_recipe(steps=3, batch_size=8, dtype=F64, experts=experts, k=k,
                      capacity_factor=no_drop_capacity_factor(experts, k))


@pytest.mark.parametrize("ep,tp,k", [(2, 2, 1), (1, 2, 2), (4, 1, 1)])
def test_training_equals_one_device(ep, tp, k):
    recipe = _recipe(k=k)
    c = compare(train_reference(recipe), expert_tp.run(recipe, world_size=4, ep=ep, tp=tp), dtype=F64)
    c.assert_ok()


def _tp_bytes(rank, world_size, recipe, ep, tp):
    log = comm.CommLog()
    expert_tp.parallel_train(rank, world_size, recipe, ep=ep, tp=tp, step_log=log)
    return {op: log.select(op=op, dims=("tp",)).bytes_sent / recipe.steps for op in ("all_gather", "reduce_scatter")}


def test_tp_exchanges_move_t_minus_1_shares_of_the_slots():
    recipe = _recipe()
    ep, tp, t_tokens, width, layers = 2, 2, 32, 32, 2
    c = no_drop_capacity_factor(4, 1) and t_tokens                 # C = T: cf = E/k
    slots = 4 // ep * ep * c                                      # per rank: local experts × ep·C
    want = layers * 2 * (tp - 1) * slots * width * 8              # forward + backward, per op
    for got in launch(_tp_bytes, 4, recipe, ep, tp, quiet=True):
        assert got == {"all_gather": want, "reduce_scatter": want}, got


@pytest.mark.parametrize("world_size, kw, words", [
    (4, dict(ep=2, tp=3), "must divide the world size"),
    (3, dict(ep=1, tp=3), "expert-TP 3 must divide each expert's 128 hidden units"),
])
def test_bad_layouts_are_refused(world_size, kw, words):
    with pytest.raises(ValueError, match=words):
        expert_tp.validate(moe_recipe(steps=1, batch_size=12, capacity_factor=4.0), world_size=world_size, **kw)

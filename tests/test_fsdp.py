"""FSDP-style wrapping: minipar's ZeRO-3 on user-chosen units against one device and against PyTorch FSDP2."""
import pytest

from minipar import launch
from minipar.check import RunResult, compare, gpt_recipe, train_reference
from minipar.data import fsdp

RECIPE = gpt_recipe(steps=3, batch_size=8, seq_len=16, optimizer="adam")


def _minipar_and_torch(rank, world_size, recipe):
    """Both implementations on the same ranks, model, batches and optimizer."""
    return {"blocks": fsdp.parallel_train(rank, world_size, recipe, units=fsdp.block_units),
            "single": fsdp.parallel_train(rank, world_size, recipe, units=fsdp.single_unit),
            "torch": fsdp.torch_fsdp2_train(rank, world_size, recipe, units=fsdp.block_units)}


@pytest.fixture(scope="module")
def runs():
    results = launch(_minipar_and_torch, 4, RECIPE, quiet=True)
    return {k: [r[k] for r in results] for k in results[0]}


def test_minipar_fsdp_matches_single_device(runs):
    compare(train_reference(RECIPE), runs["blocks"]).assert_ok()


def test_torch_fsdp2_matches_single_device(runs):
    compare(train_reference(RECIPE), runs["torch"]).assert_ok()


def test_minipar_zero3_matches_torch_fsdp2(runs):
    # The same summed gradients and the same Adam: equal to float32 rounding (default fp32 tolerance,
    # atol 2e-5 / rtol 1e-4; FSDP2 may divide before or after its reduce-scatter).
    torch_run = runs["torch"][0]
    result = compare(RunResult(torch_run.losses, torch_run.params), runs["blocks"])
    result.assert_ok()
    assert result.max_abs_diff < 2e-5


def test_the_choice_of_units_does_not_change_the_numbers(runs):
    # Not bit-exact: a parameter sits at another offset of another buffer, and gloo's reduce-scatter
    # adds the ranks' pieces in an order that depends on where the chunk boundaries fall.
    blocks = runs["blocks"][0]
    compare(RunResult(blocks.losses, blocks.params), runs["single"]).assert_ok()


def _events(rank, world_size, recipe):
    model = recipe.model()
    sharded = fsdp.fully_shard(model, recipe.optimizer, fsdp.block_units)
    for inputs, targets in recipe.batches[:2]:
        per = len(inputs) // world_size
        sharded.zero_grad()
        recipe.loss(model, inputs[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]).backward()
        sharded.step()
    return sharded.events


def test_gather_compute_free_with_prefetch():
    events = launch(_events, 2, RECIPE, quiet=True)[0]
    step1 = [(kind, unit) for step, kind, unit in events if step == 1]
    # every unit: gathered, freed, gathered again, reduce-scattered, freed — in that order
    for unit in ("(root)", "blocks.0", "blocks.1"):
        assert [k for k, u in step1 if u == unit] == ["all-gather", "free", "all-gather", "reduce-scatter",
                                                        "free"], unit
    # prefetch: in step 2 block 1 is being gathered before block 0 is freed (forward), and block 0 before
    # block 1 is freed (backward); the first step only records the order
    assert step1.index(("all-gather", "blocks.1")) < step1.index(("free", "blocks.0"))
    backward = step1[step1.index(("free", "(root)")):]
    assert backward.index(("all-gather", "blocks.0")) < backward.index(("free", "blocks.1"))
    step0 = [(kind, unit) for step, kind, unit in events if step == 0]
    assert step0.index(("all-gather", "blocks.1")) > step0.index(("free", "blocks.0"))


def test_units_must_cover_the_model_before_launch():
    with pytest.raises(ValueError, match="no unit"):
        fsdp.run(RECIPE, world_size=4, units=lambda model: list(model.blocks))
    with pytest.raises(ValueError, match="split evenly"):
        fsdp.run(RECIPE, world_size=3)

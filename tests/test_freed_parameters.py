"""Reading a ZeRO-3/FSDP parameter between steps raises a Python error saying what to do (it used to read
freed storage: SIGSEGV, or a storage error, or a 4,786-byte state_dict that failed only when loaded)."""
import io
import warnings

import pytest
import torch

from minipar import launch
from minipar.check import gpt_recipe
from minipar.data.sharded_parameter import FreedGradientWarning, FreedParameterError
from minipar.data.zero import ZeRO

RECIPE = gpt_recipe(steps=1, batch_size=4, seq_len=8, optimizer="adam")


def _read_between_steps(rank, world_size, recipe):
    model = recipe.model()
    zero = ZeRO(model, recipe.optimizer, 3)
    x, y = recipe.batches[0]
    zero.zero_grad()
    recipe.loss(model, x[rank::world_size], y[rank::world_size]).backward()
    zero.step()
    w = model.blocks[0].mlp.fc.weight
    errors = {}
    reads = {"sum": lambda: w.sum(), "clone": lambda: w.clone(), "slice": lambda: w.view(-1)[:3],
             "repr": lambda: repr(w), "state_dict": lambda: torch.save(model.state_dict(), io.BytesIO())}
    for what, read in reads.items():
        try:
            read()
            errors[what] = None
        except FreedParameterError as e:
            errors[what] = str(e)
    metadata = (tuple(w.shape), w.dtype, w.requires_grad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors["grad"] = (w.grad, [str(c.message) for c in caught if c.category is FreedGradientWarning])
    with zero.gathered():
        inside = w.detach().clone()
    full = zero.full_parameters()["blocks.0.mlp.fc.weight"]
    try:
        w.sum()
        freed_again = False
    except FreedParameterError:
        freed_again = True
    # A second step without zero.zero_grad(): its gradients are reduced and added (they used to be ignored).
    recipe.loss(model, x[rank::world_size], y[rank::world_size]).backward()
    zero.step()
    second = [unit for step, kind, unit in zero.events if step == 1 and kind == "reduce-scatter"]
    return errors, metadata, torch.equal(inside, full), freed_again, (second, [u.label for u in zero.units])


@pytest.fixture(scope="module")
def outcome():
    return launch(_read_between_steps, 2, RECIPE, quiet=True)[0]


@pytest.mark.parametrize("what", ["sum", "clone", "slice", "repr", "state_dict"])
def test_reading_a_freed_parameter_raises_and_says_what_to_do(outcome, what):
    message = outcome[0][what]
    assert message is not None, f"{what} did not raise"
    name = "'tok_emb.weight'" if what == "state_dict" else "'blocks.0.mlp.fc.weight'"   # its first parameter
    assert f"{name} is sharded over 2 ranks" in message
    assert "zero.gathered()" in message and "full_parameters()" in message


def test_metadata_stays_readable(outcome):
    shape, dtype, requires_grad = outcome[1]
    assert len(shape) == 2 and dtype == torch.float32 and requires_grad


def test_reading_the_gradient_of_a_sharded_parameter_says_where_it_is(outcome):
    grad, messages = outcome[0]["grad"]
    assert grad is None and len(messages) == 1           # a warning, so code that sums .grad still runs
    assert "'blocks.0.mlp.fc.weight' was reduce-scattered" in messages[0] and "full_gradients()" in messages[0]


def test_gathered_gives_the_full_parameter_then_frees_it(outcome):
    _, _, equal_to_full_parameters, freed_again, _ = outcome
    assert equal_to_full_parameters and freed_again


def test_a_step_without_zero_grad_still_reduces_the_new_gradients(outcome):
    reduced_in_step_two, units = outcome[4]
    assert sorted(reduced_in_step_two) == sorted(units)      # every unit reduce-scattered its gradient again

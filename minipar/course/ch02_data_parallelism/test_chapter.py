"""Chapter 02's timing helpers: DP's five exchanges as processes equal one device; refused input; seed 002's machine."""
import pytest
import torch

from minipar.course.ch02_data_parallelism import timing


def _dp_train(rank, world_size, recipe):
    from minipar.check import RunResult
    model = recipe.model()
    opt = recipe.optimizer(model.parameters())
    for x, y in recipe.batches:
        timing.dp_step(rank, world_size, model, opt, x, y)
    return RunResult(None, {n: p.detach().clone() for n, p in model.named_parameters()})


def test_dp_step_as_processes_equals_one_device():
    from minipar.check import gpt_recipe, train_reference
    from minipar.launcher import launch
    recipe = gpt_recipe(steps=2, batch_size=8, optimizer="sgd")
    recipe.dtype = torch.float64
    recipe.model = (lambda make: lambda: make().double())(recipe.model)
    want = train_reference(recipe).params
    got = launch(_dp_train, 2, recipe, quiet=True)[0].params       # rank 0 holds DP's model
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-12


def test_measure_refuses_one_step_before_launch():
    with pytest.raises(ValueError, match="at least 2"):
        timing.measure(2, steps=1)


def test_titan_rtx_links_and_peaks():
    assert timing.titan_rtx(2).intra_bw == 50e9 and timing.titan_rtx(2, nvlink=False).intra_bw == 15.75e9
    assert timing.titan_rtx(2, fp32=True).peak_flops == 16.3e12

"""DataParallel with threads: equals one device (float32 tolerance of minipar.check; bit-exact with one
device), and its five exchanges per step move exactly the bytes of the formula."""
import pytest
import torch

from minipar.check import RunResult, compare, gpt_recipe, mlp_recipe, train_reference
from minipar.data import dp
from minipar.launcher import launch


def test_four_devices_match_one_device():
    recipe = gpt_recipe(steps=3, batch_size=8)
    compare(train_reference(recipe), [dp.run(recipe, devices=4)]).assert_ok()


def test_one_device_is_bit_exact():
    recipe = mlp_recipe(steps=3)
    c = compare(train_reference(recipe), [dp.run(recipe, devices=1)], atol=0, rtol=0)
    assert c.matches and c.max_abs_diff == 0.0, str(c)


def test_five_exchanges_move_the_formula_bytes_every_step():
    recipe = gpt_recipe(steps=2, batch_size=8)
    logs = []
    dp.run(recipe, devices=4, step_logs=logs)
    x, _ = recipe.batches[0]
    model = recipe.model()
    params = sum(p.numel() * 4 for p in model.parameters())
    outputs = x.numel() * model.cfg.vocab_size * 4                  # logits, float32
    want = dp.predicted_exchange_bytes(4, params, x.numel() * x.element_size(), outputs)
    assert len(logs) == 2
    for log in logs:
        assert log.by_exchange() == pytest.approx(want)
        assert sorted(i for i, _, _ in log.spans) == [0, 1, 2, 3]   # one forward thread per replica
    # Device 0's share grows with N: the replicate + reduce traffic is 2(N-1)·P.
    assert want["replicate model"] + want["reduce grads"] == 2 * 3 * params


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="not divisible"):
        dp.run(gpt_recipe(steps=1, batch_size=6), devices=4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_on_two_gpus():
    recipe = mlp_recipe(steps=3)
    compare(train_reference(recipe), [dp.run(recipe, devices=["cuda:0", "cuda:1"])]).assert_ok()


def _dp_train(rank, world_size, recipe):
    model = recipe.model()
    opt = recipe.optimizer(model.parameters())
    for x, y in recipe.batches:
        dp.step_on_ranks(rank, world_size, model, opt, x, y)
    return RunResult(None, {n: p.detach().clone() for n, p in model.named_parameters()})


def test_the_five_exchanges_as_processes_equal_one_device():
    recipe = gpt_recipe(steps=2, batch_size=8, optimizer="sgd")
    recipe.dtype = torch.float64
    recipe.model = (lambda make: lambda: make().double())(recipe.model)
    want = train_reference(recipe).params
    got = launch(_dp_train, 2, recipe, quiet=True)[0].params       # rank 0 holds DP's model
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-12

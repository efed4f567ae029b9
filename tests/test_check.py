"""The equivalence harness must pass a correct strategy and fail wrong ones (a test that cannot fail is a
defect, so the harness itself is tested against plausible mistakes)."""
import pytest
import torch
import torch.distributed as dist

from minipar.check import RunResult, check_equivalence, compare, gpt_recipe, mlp_recipe, train_reference


def _tiny_data_parallel(rank, world_size, recipe, divide=True, drift_rank=None):
    """The smallest data parallelism: each rank takes its slice of the global batch, gradients are
    summed over ranks and divided by N (the mean loss over the global batch)."""
    model = recipe.model()
    opt = recipe.optimizer(model.parameters())
    losses = []
    for inputs, targets in recipe.batches:
        x, y = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
        opt.zero_grad()
        loss = recipe.loss(model, x, y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            if divide:
                p.grad /= world_size
        opt.step()
        if rank == drift_rank:
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return RunResult(losses, {n: p.detach() for n, p in model.named_parameters()})


def test_a_correct_strategy_matches():
    result = check_equivalence(_tiny_data_parallel, 2, mlp_recipe(steps=3)).assert_ok()
    assert result.max_abs_diff < 1e-5 and len(result.loss_diffs) == 3


def test_the_gpt_with_adam_matches_on_4_ranks():
    check_equivalence(_tiny_data_parallel, 4, gpt_recipe(steps=2, batch_size=8)).assert_ok()


def test_a_missing_division_is_caught():
    result = check_equivalence(_tiny_data_parallel, 2, mlp_recipe(steps=2), divide=False)
    assert not result.matches
    assert "exceeds" in str(result)
    with pytest.raises(AssertionError, match="DOES NOT MATCH"):
        result.assert_ok()


def test_a_replica_that_drifts_is_caught_on_its_rank():
    result = check_equivalence(_tiny_data_parallel, 2, mlp_recipe(steps=2), drift_rank=1)
    assert not result.matches
    assert any("on rank 1" in p for p in result.problems)
    assert not any("on rank 0" in p for p in result.problems)


def test_missing_and_misshapen_parameters_are_reported():
    ref = train_reference(mlp_recipe(steps=1))
    partial = {k: v for k, v in list(ref.params.items())[:2]}
    assert "no rank reported" in str(compare(ref, [RunResult(ref.losses, partial)]))
    assert compare(ref, [RunResult(ref.losses, partial)], require_all_params=False).matches
    name = next(iter(ref.params))
    bad = dict(ref.params, **{name: ref.params[name].t()})
    assert "shape" in str(compare(ref, [RunResult(ref.losses, bad)]))
    assert "no rank reported its losses" in str(compare(ref, [RunResult(None, ref.params)]))


def test_exact_mode_distinguishes_one_ulp():
    ref = train_reference(mlp_recipe(steps=1))
    assert compare(ref, [ref], atol=0, rtol=0).matches
    name = next(iter(ref.params))
    nudged = dict(ref.params, **{name: torch.nextafter(ref.params[name], torch.tensor(float("inf")))})
    assert not compare(ref, [RunResult(ref.losses, nudged)], atol=0, rtol=0).matches


def test_relative_error_is_reported_only_where_the_reference_is_not_zero():
    """A parameter whose gradient is zero analytically (attention's key bias) stays ~0; rounding noise over a
    ~0 reference must not show up as a large relative error — but a real relative error elsewhere must."""
    ref = RunResult([1.0], {"k_bias": torch.zeros(3), "w": torch.full((2,), 2.0)})
    noise = RunResult([1.0], {"k_bias": torch.full((3,), 4e-14), "w": torch.full((2,), 2.0)})
    c = compare(ref, [noise], atol=1e-10, rtol=1e-9)
    assert c.matches and c.max_rel_diff == 0.0 and c.max_abs_diff == pytest.approx(4e-14)
    off = RunResult([1.0], {"k_bias": torch.zeros(3), "w": torch.tensor([2.0, 2.002])})
    c = compare(ref, [off], atol=1e-10, rtol=1e-9)
    assert not c.matches and c.max_rel_diff == pytest.approx(1e-3, rel=1e-3) and "where |ref| > atol" in c.details()

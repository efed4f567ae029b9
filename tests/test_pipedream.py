"""PipeDream's asynchronous variants equal their update rules (not synchronous training, which they are not).

Tolerance: float32 defaults of minipar.check (atol 2e-5, rtol 1e-4); observed max |Δ| ≤ 3e-8: the pipeline
sums micro-batch gradients where the reference takes one batch gradient.
"""
import pytest

from minipar import launch
from minipar.check import compare, gpt_recipe, mlp_recipe, train_reference
from minipar.pipeline.pipedream import parallel_train, reference_2bw, reference_async, validate

MLP = mlp_recipe(steps=6, batch_size=8, sizes=(8, 16, 16, 16, 8))
GPT = gpt_recipe(steps=5, batch_size=8, seq_len=8, n_layer=4, n_embd=16, n_head=2, optimizer="sgd")
LR = 0.1                                             # the recipes' SGD learning rate: ν in the rules


@pytest.mark.parametrize("recipe,p", [(MLP, 2), (MLP, 4), (GPT, 4)])
def test_2bw_follows_its_update_rule_with_two_weight_buffers(recipe, p):
    runs = launch(parallel_train, p, recipe, mode="2bw", m=4, lr=LR, quiet=True)
    compare(reference_2bw(recipe, LR), runs).assert_ok()
    assert all(r.most_versions == 2 for r in runs)               # double-buffered, never a third
    # every micro-batch of batch t ran forward and backward on version t - 1, on every stage
    assert all(v == max(mb // 4 - 1, 0) for r in runs for _, _, mb, v in r.versions_used)
    # and it is not synchronous training: the delayed gradient moves the weights elsewhere
    assert compare(train_reference(recipe), runs).max_abs_diff > 1e-3


@pytest.mark.parametrize("recipe,p", [(MLP, 2), (GPT, 4)])
def test_async_pipedream_with_weight_stashing_follows_its_update_rule(recipe, p):
    runs = launch(parallel_train, p, recipe, mode="async", m=1, lr=LR, quiet=True)
    compare(reference_async(recipe, p, LR), runs).assert_ok()
    # stage r stashes one version per micro-batch in flight: p - r (the newest counted too, at least 2)
    assert [r.most_versions for r in runs] == [max(p - r, 2) for r in range(p)]
    # input j's forward on stage r used version j - (p-r-1) (r's updates so far), its backward the same
    for r, run in enumerate(runs):
        used = {(k, j): v for k, s, j, v in run.versions_used}
        assert {v for (k, j), v in used.items() if k == "F"} and len(used) == 2 * recipe.steps
        assert all(used[("F", j)] == max(0, j - (p - r - 1)) == used[("BW", j)] for j in range(recipe.steps))
    assert compare(train_reference(recipe), runs).max_abs_diff > 1e-4


def test_async_reference_is_not_the_2bw_rule():
    # the two rules differ (per-stage staleness vs one version of delay everywhere): the tests can tell
    assert compare(reference_2bw(MLP, LR), [reference_async(MLP, 4, LR)]).max_abs_diff > 1e-4


def test_bad_configurations_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="m >= p"):
        validate(MLP, world_size=4, mode="2bw", m=2)
    with pytest.raises(ValueError, match="mode must be"):
        validate(MLP, world_size=2, mode="1f1b", m=4)
    with pytest.raises(ValueError, match="divisible by p"):
        validate(MLP, world_size=3, mode="async", m=1)

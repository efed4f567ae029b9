"""DiLoCo (Douillard et al. 2023) and its streaming variant equal their own rule, one all-reduce of the
parameters per H inner steps; at H = 1 with outer lr 1 and no momentum it is parameter averaging after
every inner step — synchronous training when the inner optimizer is plain SGD, not when it is AdamW.

The rule is :func:`minipar.data.diloco.diloco_reference` (the replicas one after the other in one process).
float64, compare's float64 tolerance (atol 1e-10, rtol 1e-9); observed max |Δ| = 0 on 2 ranks.
"""
import pytest
import torch

from minipar.check import RunResult, compare, gpt_recipe, train_reference
from minipar.data import diloco
from minipar.data.diloco import diloco_reference, fragments_of, sync_steps
from minipar.loop import shard_batch


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def gpt64(steps=8, optimizer="adam"):
    r = gpt_recipe(steps=steps, batch_size=8, seq_len=8, n_layer=2, n_embd=16, n_head=2, optimizer=optimizer)
    r.dtype = torch.float64
    if optimizer == "adam":
        r.optimizer = adamw                               # DiLoCo's inner optimizer
    return r


@pytest.fixture(scope="module")
def synchronous():
    """Synchronous training of gpt64() on one device, computed once for the three configurations below."""
    return train_reference(gpt64())


@pytest.mark.parametrize("world_size,H,fragments", [(2, 4, 1), (4, 4, 2), (2, 2, 2)])
def test_diloco_follows_its_rule(synchronous, world_size, H, fragments):
    recipe = gpt64()
    runs = diloco.run(recipe, world_size=world_size, H=H, fragments=fragments)
    compare(diloco_reference(recipe, world_size, H, fragments=fragments), runs, dtype=torch.float64).assert_ok()
    # and it is not synchronous training
    assert compare(synchronous, runs, dtype=torch.float64).max_abs_diff > 1e-3


def test_h1_outer_sgd_lr1_with_inner_sgd_is_synchronous_training():
    # θ ← θ − 1·(1/N)Σ(θ − θ_i) = (1/N)Σ θ_i = θ − lr·(1/N)Σ g_i: DDP's step
    recipe = gpt64(steps=4, optimizer="sgd")
    runs = diloco.run(recipe, world_size=2, H=1, outer_lr=1.0, outer_momentum=0.0)
    compare(train_reference(recipe), runs, dtype=torch.float64).assert_ok()


def parameter_averaging(recipe, world_size):
    """Every replica takes one inner step from the same parameters, then the parameters are averaged."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                              # as the ranks run (and no fight for 2 cores)
    try:
        return _parameter_averaging(recipe, world_size)
    finally:
        torch.set_num_threads(threads)


def _parameter_averaging(recipe, world_size):
    replicas = [recipe.model().to(recipe.dtype) for _ in range(world_size)]
    inners = [recipe.optimizer(m.parameters()) for m in replicas]
    losses = []
    for batch in recipe.batches:
        step = []
        for i, (m, opt) in enumerate(zip(replicas, inners)):
            opt.zero_grad()
            loss = recipe.loss(m, *shard_batch(batch, i, world_size))
            loss.backward()
            opt.step()
            step.append(loss.item())
        losses.append(sum(step) / world_size)
        with torch.no_grad():
            for ps in zip(*(m.parameters() for m in replicas)):
                mean = sum(ps) / world_size
                for p in ps:
                    p.copy_(mean)
    return RunResult(losses, {n: p.detach().clone() for n, p in replicas[0].named_parameters()})


def test_h1_outer_sgd_lr1_with_inner_adamw_is_parameter_averaging_not_synchronous():
    recipe = gpt64(steps=4)
    runs = diloco.run(recipe, world_size=2, H=1, outer_lr=1.0, outer_momentum=0.0)
    compare(parameter_averaging(recipe, 2), runs, dtype=torch.float64).assert_ok()
    # AdamW is not linear in the gradient: the mean of Adam steps is not Adam on the mean gradient
    assert compare(train_reference(recipe), runs, dtype=torch.float64).max_abs_diff > 1e-4


@pytest.mark.parametrize("world_size,fragments", [(2, 1), (4, 1), (2, 2), (4, 4)])
def test_one_all_reduce_of_the_parameters_per_h_steps(world_size, fragments):
    H = 4
    recipe = gpt_recipe(steps=8, batch_size=8, seq_len=8, n_layer=2, n_embd=16, n_head=2)
    params = list(recipe.model().parameters())
    param_bytes = 4 * sum(p.numel() for p in params)
    runs = diloco.run(recipe, world_size=world_size, H=H, fragments=fragments)
    for run in runs:
        for cycle in (run.bytes_sent[:H], run.bytes_sent[H:2 * H]):
            assert sum(cycle) == 2 * (world_size - 1) / world_size * param_bytes
        # fragment f's sync, after inner step (f+1)·H/F of each cycle, carries that fragment only
        frags = fragments_of(params, fragments)
        for step, sent in enumerate(run.bytes_sent, start=1):
            due = sync_steps(step, H, fragments)
            want = sum(4 * p.numel() for f in due for p in frags[f])
            assert sent == 2 * (world_size - 1) / world_size * want


def test_fragments_and_schedule():
    params = list(gpt_recipe(n_layer=2, n_embd=16, n_head=2).model().parameters())
    cut = fragments_of(params, 3)
    assert [p for f in cut for p in f] == params and all(cut)
    assert [sync_steps(t, 4, 1) for t in range(1, 9)] == [[], [], [], [0], [], [], [], [0]]
    assert [sync_steps(t, 4, 2) for t in range(1, 5)] == [[], [0], [], [1]]
    assert [sync_steps(t, 4, 4) for t in range(1, 5)] == [[0], [1], [2], [3]]


def test_bad_configurations_fail_before_any_process_starts():
    recipe = gpt64()
    with pytest.raises(ValueError, match="H must be a positive integer"):
        diloco.run(recipe, world_size=2, H=0)
    with pytest.raises(ValueError, match="F dividing H"):
        diloco.run(recipe, world_size=2, H=4, fragments=3)
    with pytest.raises(ValueError, match="outer_momentum"):
        diloco.run(recipe, world_size=2, H=4, outer_momentum=1.0)
    with pytest.raises(ValueError, match="not divisible by 3"):
        diloco.run(recipe, world_size=3, H=4)
    with pytest.raises(ValueError, match="non-empty fragments"):
        diloco.run(recipe, world_size=2, H=64, fragments=64)


"""PowerSGD (Vogels et al. 2019) equals its own update rule, not synchronous training — except at full rank —
and sends the bytes its formula says; beside it, PyTorch's DDP with ``powerSGD_hook`` on the same model.

The rule is :func:`minipar.data.powersgd.powersgd_reference`: one process, the shards' gradients one after the
other, P and Q averaged by a plain mean. float64, compare's float64 tolerance (atol 1e-10, rtol 1e-9);
observed max |Δ| = 0 on 2 ranks (a sum of two is the same in any order).
"""
import pytest
import torch

from minipar import launch
from minipar.check import compare, gpt_recipe, train_reference
from minipar.data import powersgd
from minipar.data.powersgd import PowerSGDReducer, powersgd_bytes, powersgd_reference, torch_hook_run
from minipar.loop import shard_batch

FULL_RANK = 10**6                        # r ≥ min(n, m) for every matrix: clipped to it


def gpt64(steps=4, optimizer="adam"):
    r = gpt_recipe(steps=steps, batch_size=8, seq_len=8, n_layer=2, n_embd=16, n_head=2, optimizer=optimizer)
    r.dtype = torch.float64
    return r


@pytest.mark.parametrize("world_size,rank_r,start_step", [(2, 2, 0), (4, 1, 0), (2, 1, 2)])
def test_powersgd_follows_its_rule_step_by_step(world_size, rank_r, start_step):
    recipe = gpt64()
    runs = powersgd.run(recipe, world_size=world_size, rank_r=rank_r, start_step=start_step)
    compare(powersgd_reference(recipe, world_size, rank_r, start_step=start_step), runs,
            dtype=torch.float64).assert_ok()


def _several(rank, world_size, recipe, configs):
    return [powersgd.parallel_train(rank, world_size, recipe, **c) for c in configs]


def _runs(recipe, world_size, configs):
    """powersgd.run for each config, one after the other in one launch: per config, the per-rank runs."""
    for c in configs:
        powersgd.validate(recipe, world_size=world_size, **c)
    out = launch(_several, world_size, recipe, configs, quiet=True)
    return [[per_rank[i] for per_rank in out] for i in range(len(configs))]


def test_low_rank_is_not_synchronous_training_full_rank_is():
    recipe = gpt64(optimizer="sgd")
    synchronous = train_reference(recipe)                      # = DDP (tests/test_ddp.py)
    # both runs in one launch (one set of processes instead of two)
    low, full = _runs(recipe, 2, [dict(rank_r=1), dict(rank_r=FULL_RANK, min_compression_rate=0.0)])
    assert compare(synchronous, low, dtype=torch.float64).max_abs_diff > 1e-3     # so the check can fail
    # full rank, every matrix compressed (rate 0): P̂ P̂ᵀ projects onto all of M's columns, M̂ = mean M
    compare(synchronous, full, dtype=torch.float64).assert_ok()


def _errors_after_two_steps(rank, world_size, recipe):
    model = recipe.model().to(recipe.dtype)
    reducer = PowerSGDReducer(model.parameters(), FULL_RANK, min_compression_rate=0.0)
    for batch in recipe.batches[:2]:
        model.zero_grad(set_to_none=True)
        recipe.loss(model, *shard_batch(batch, rank, world_size)).backward()
        reducer.reduce()
    return reducer.errors


def test_full_rank_errors_are_each_ranks_deviation_and_sum_to_zero():
    # e_i = M_i − mean M: not zero on a rank, but zero summed over ranks, so it never changes mean M
    errors = launch(_errors_after_two_steps, 2, gpt64(), quiet=True)
    for e0, e1 in zip(*errors):
        assert e0.abs().max() > 1e-6
        assert (e0 + e1).abs().max() < 1e-12


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_per_step_equal_the_formula_and_shrink_with_r(world_size):
    recipe = gpt_recipe(steps=2, batch_size=8, seq_len=8, n_layer=2, n_embd=16, n_head=2)
    shapes = [p.shape for p in recipe.model().parameters()]
    ddp_bytes = 2 * (world_size - 1) / world_size * 4 * sum(s.numel() for s in shapes)
    sent = {}
    for r, runs in zip((1, 2, 4), _runs(recipe, world_size, [dict(rank_r=r) for r in (1, 2, 4)])):  # one launch
        want = powersgd_bytes(shapes, r, world_size, 4)
        assert all(b == want for run in runs for b in run.bytes_sent), (r, runs[0].bytes_sent, want)
        sent[r] = want
    assert sent[1] < sent[2] < sent[4] < ddp_bytes
    # by hand, r = 1, N = 2 (2(N−1)/N = 1): a bias whole; 48×16 as P, Q: 48 + 16; 2×2 whole ((2+2)·1 ≥ 4)
    assert powersgd_bytes([(8,), (48, 16), (2, 2)], 1, 2, 4) == 4 * (8 + 64 + 4)


def test_beside_pytorch_powersgd_hook():
    # same model, same steps, start_step 2 (PyTorch's minimum with error feedback and warm start):
    # identical while both all-reduce plainly, then close (the hook draws its first Q from its own seed)
    recipe = gpt_recipe(steps=8, batch_size=8, seq_len=8, n_layer=2, n_embd=16, n_head=2)
    hook_run = torch_hook_run(recipe, 2, 2, start_step=2)
    our_run = powersgd.run(recipe, world_size=2, rank_r=2, start_step=2)[0]
    theirs, ours = hook_run.losses, our_run.losses
    assert ours[:3] == pytest.approx(theirs[:3], abs=1e-6)    # step 2's loss is before its compression
    assert ours == pytest.approx(theirs, abs=0.03)
    assert ours[-1] < ours[0] and theirs[-1] < theirs[0]
    # both sockets carry minipar's modelled bytes plus gloo's framing (observed: 9280 on the wire for 7552
    # modelled per compressed step, 37184 for 36608 per plain one, the same for both)
    for modelled, mine, hook in zip(our_run.bytes_sent, our_run.wire_bytes, hook_run.wire_bytes):
        assert modelled <= hook <= 1.3 * modelled
        assert mine == pytest.approx(hook, rel=0.05)
    assert hook_run.wire_bytes[-1] < 0.3 * hook_run.wire_bytes[0]


def test_bad_configurations_fail_before_any_process_starts():
    recipe = gpt64()
    with pytest.raises(ValueError, match="rank_r must be a positive integer"):
        powersgd.validate(recipe, world_size=2, rank_r=0)
    with pytest.raises(ValueError, match="world_size 1"):
        powersgd.run(recipe, world_size=1, rank_r=2)
    with pytest.raises(ValueError, match="not divisible by 3"):
        powersgd.run(recipe, world_size=3, rank_r=2)
    with pytest.raises(ValueError, match="start_step >= 2"):
        torch_hook_run(recipe, 2, 2, start_step=1)

"""Silent data corruption (minipar.debug.sdc): a bit flipped in one rank's gradient after the reduction is caught
before the optimizer step, naming the rank and the tensor, on dp 2, dp 2 × tp 2, dp 2 × pp 2 and dp 3 (a
majority); the replay of the suspect step names the rank where two replicas cannot, and the run goes on equal to
the run that never flipped (bit for bit); with replay off the parameters are untouched. A float-sum fingerprint
misses a low-bit flip that the integer fingerprint catches; ZeRO is refused (no replicas to compare)."""
import pytest
import torch

from minipar import launch
from minipar.check import gpt_recipe
from minipar.debug.sdc import CheckedTrainer, Flip, ReplicaMismatch, fingerprint, flip_bit
from minipar.hybrid.parallel3d import Trainer3D


def recipe():
    r = gpt_recipe(steps=2, batch_size=12, seq_len=8, n_layer=2, n_embd=16, n_head=2)
    r.dtype = torch.float64
    return r


def flipped_rank(rank, world_size, recipe, layout, flip):
    """The checked run with ``flip`` planted at step 1, then a plain run: (findings, same parameters?, the
    raise-mode error and whether the parameters stayed as they were)."""
    checked = CheckedTrainer(Trainer3D(rank, world_size, recipe, **layout), flip=flip)
    plain = Trainer3D(rank, world_size, recipe, **layout)
    for i in range(recipe.steps):
        checked.step(*recipe.batches[i], i)
        plain.step(*recipe.batches[i], i)
    a, b = checked.trainer.full_params(), plain.full_params()
    same = a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    strict = CheckedTrainer(Trainer3D(rank, world_size, recipe, **layout), replay=False,
                            flip=Flip(0, flip.rank, flip.tensor, flip.index, flip.bit))
    before = strict.trainer.full_params()
    try:
        strict.step(*recipe.batches[0], 0)
        raised = None
    except ReplicaMismatch as exc:
        raised = str(exc)
    after = strict.trainer.full_params()
    untouched = all(torch.equal(before[n], after[n]) for n in before)
    return checked.findings, same, raised, untouched, checked.ranks


@pytest.mark.parametrize("world_size, layout, flip", [
    (2, dict(dp=2, micro_batches=2), Flip(1, 1, "blocks.1.mlp.fc.weight", 7, 40)),
    (4, dict(dp=2, tp=2, micro_batches=2), Flip(1, 3, "blocks.0.attn.qkv.weight", 5, 2)),
    (4, dict(dp=2, pp=2, micro_batches=2), Flip(1, 2, "tok_emb.weight", 3, 52)),
    (3, dict(dp=3, micro_batches=1), Flip(1, 0, "ln_f.weight", 1, 63)),
], ids=["dp2", "dp2xtp2", "dp2xpp2", "dp3-majority"])
def test_a_flipped_bit_is_caught_before_the_optimizer_step(world_size, layout, flip):
    results = launch(flipped_rank, world_size, recipe(), layout, flip, quiet=True)
    for rank, (findings, same, raised, untouched, replicas) in enumerate(results):
        assert same, f"rank {rank}: the replayed run differs from the run that never flipped"
        assert untouched and raised is not None, f"rank {rank}: the flip reached the parameters"
        if flip.rank in replicas:                             # the flipped rank's replicas name it and the tensor
            assert flip.tensor in raised, (rank, raised)
            assert [(f.step, f.rank, f.tensor) for f in findings] == [(1, flip.rank, flip.tensor)], (rank, findings)
        else:                                                 # another stage or tp coordinate: replays, sees nothing
            assert "another replica group" in raised and findings == [], (rank, raised, findings)
    if world_size == 3:
        assert f"rank {flip.rank}'s gradient of {flip.tensor}" in results[1][2]
        assert results[1][0][0].how == "majority"


def test_the_integer_fingerprint_catches_what_a_float_sum_misses():
    g = torch.tensor([1.0e6, 1.0e-9, 3.0], dtype=torch.float64)
    before_int, before_sum = fingerprint([g]), g.sum()
    flip_bit(g, 1, 0)                                          # the lowest mantissa bit of the tiny element
    assert g.sum() == before_sum                               # absorbed: a float checksum sees nothing
    assert not torch.equal(fingerprint([g]), before_int)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = torch.randn(100, dtype=torch.float64).to(dtype)
        base = fingerprint([t])
        for bit in range(8 * t.element_size()):
            u = t.clone()
            flip_bit(u, 17, bit)
            assert not torch.equal(fingerprint([u]), base), (dtype, bit)


def _zero_rank(rank, world_size, recipe):
    try:
        CheckedTrainer(Trainer3D(rank, world_size, recipe, dp=2, zero=1, micro_batches=2))
    except ValueError as exc:
        return str(exc)


def test_zero_is_refused_with_the_reason():
    assert all("ZeRO" in why for why in launch(_zero_rank, 2, recipe(), quiet=True))


def test_train_check_gradients_runs_and_refuses_what_it_cannot_check(capsys):
    from minipar.hybrid.cli import main as train_main
    flags = ["--steps", "1", "--n-layer", "2", "--batch-size", "4", "--seq-len", "8", "--micro-batches", "2"]
    assert train_main(flags + ["--dp", "2", "--check-gradients"]) == 0
    for bad in (["--dp", "1"], ["--dp", "2", "--zero", "1"]):
        with pytest.raises(SystemExit) as exit_:
            train_main(flags + bad + ["--check-gradients"])
        assert exit_.value.code == 2
    assert "--check-gradients compares data-parallel replicas" in capsys.readouterr().err


def _hsdp_rank(rank, world_size, recipe, flip):
    """HSDP on 2 declared nodes of 2: ZeRO-3 inside a node, the shards all-reduced across; the check over the
    replicate group. Returns (the error, whether the parameters stayed as they were)."""
    from minipar.data.hsdp import node_groups
    from minipar.data.units import block_units
    from minipar.data.zero import ZeRO
    from minipar.debug.sdc import guard_optimizer
    from minipar.loop import shard_batch
    node, cross = node_groups(world_size, 2)
    model = recipe.model().to(recipe.dtype)
    zero = ZeRO(model, recipe.optimizer, 3, node, block_units(model), replicate_group=cross)
    names = [f"unit {i}'s shard" for i in range(len(zero.units))]
    guard_optimizer(zero.optimizer, lambda: [u.master.grad for u in zero.units], names, cross, flip=flip)
    before = zero.full_parameters()
    x, y = shard_batch(recipe.batches[0], rank, world_size)
    zero.zero_grad()
    recipe.loss(model, x, y).backward()
    try:
        zero.step()
        raised = None
    except ReplicaMismatch as exc:
        raised = str(exc)
    after = zero.full_parameters()
    return raised, all(torch.equal(before[n], after[n]) for n in before)


def test_hsdp_shard_gradients_are_checked_across_the_replicate_group():
    flip = Flip(0, 3, "unit 1's shard", 2, 33)
    results = launch(_hsdp_rank, 4, recipe(), flip, quiet=True)
    for rank, (raised, untouched) in enumerate(results):
        assert raised is not None and untouched, (rank, raised)
        if rank in (1, 3):                                   # rank 3's replicate group: the shard is named
            assert "unit 1's shard on ranks 1, 3" in raised, raised
        else:
            assert "another replica group" in raised, raised

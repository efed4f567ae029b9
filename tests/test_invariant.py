"""The invariant mode (minipar.invariant): in float32, after 2 AdamW steps, every layout's losses and parameters
are torch.equal to one device's in the same mode; with the mode off they are not (so these tests can fail);
train --invariant prints one process's losses digit for digit; layouts it cannot make bitwise are refused."""
import dataclasses
import json

import pytest
import torch

import minipar
import minipar.invariant_mode as invariant_mode
from minipar import canonical
from minipar.hybrid import cli
from minipar.hybrid.parallel3d import validate
from minipar.hybrid.runner import run
from minipar.recipe import gpt_recipe


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def recipe():
    # 2 steps: the second uses AdamW's state (m, v) from the first; 3 showed the same for ~15 % more CPU
    tiny = gpt_recipe(steps=2, batch_size=8, seq_len=8, n_layer=2, n_embd=16, vocab_size=32, block_size=8)
    return dataclasses.replace(tiny, optimizer=adamw)          # float32


def trained(invariant_on: bool, **dims):
    ranks = run(recipe(), invariant=invariant_on, **dims)
    losses = next(r.losses for r in ranks if r.losses is not None)
    params = {n: p for r in ranks for n, p in r.params.items()}
    return losses, params


def differing(reference, other) -> list:
    """The names (and "losses") where ``other`` is not bitwise ``reference``."""
    (ref_losses, ref_params), (losses, params) = reference, other
    bad = [n for n in ref_params if not torch.equal(ref_params[n], params[n])]
    return bad + (["losses"] if losses != ref_losses else [])


LAYOUTS = {
    "dp2": dict(dp=2), "dp4": dict(dp=4), "m2": dict(micro_batches=2), "m4": dict(micro_batches=4),
    "tp2+sp": dict(tp=2, sp=True), "tp4+sp": dict(tp=4, sp=True), "dp2xtp2": dict(dp=2, tp=2, micro_batches=2),
    "dp2xpp2xtp2": dict(dp=2, pp=2, tp=2, micro_batches=2), "cp2": dict(cp=2),
    "cp2-ulysses": dict(cp=2, cp_method="ulysses"),
}


def test_every_layout_equals_one_device_bitwise():
    """One reference, then each layout (tp: the vocabulary-parallel loss; +sp: sequence parallelism): losses
    and all parameters torch.equal (cp: the ring's K, V gathered in key order; Ulysses' heads whole)."""
    reference = trained(True, micro_batches=1)
    found = {name: differing(reference, trained(True, **{"micro_batches": 1, **dims}))
             for name, dims in LAYOUTS.items()}
    assert found == {name: [] for name in LAYOUTS}


def test_default_mode_is_not_bitwise():
    """The same comparisons with the mode off part in the last bits (so the test above can fail): dp 2,
    tp 2 + sp and cp 2 (ring) against one device, every parameter tensor of the tiny model differs."""
    reference = trained(False, micro_batches=1)
    for dims in (dict(dp=2), dict(tp=2, sp=True), dict(cp=2)):
        bad = differing(reference, trained(False, micro_batches=1, **dims))
        assert "tok_emb.weight" in bad and "blocks.0.attn.qkv.weight" in bad, (dims, bad)


def _cli_losses(capfd, *flags) -> list:
    argv = ["--invariant", "--json", "--steps", "2", "--batch-size", "8", "--seq-len", "8", "--n-layer", "2",
            "--n-embd", "16", "--micro-batches", "2", *flags]
    assert cli.main(argv) == 0
    return [json.loads(line)["loss"] for line in capfd.readouterr().out.splitlines()]


def test_train_invariant_prints_one_process_losses(capfd):
    one = _cli_losses(capfd)
    assert len(one) == 2                                 # 2 steps, as recipe()
    assert _cli_losses(capfd, "--dp", "2", "--tp", "2") == one
    assert _cli_losses(capfd, "--dp", "2", "--pp", "2", "--tp", "2") == one


@pytest.mark.parametrize("dims, batch, words", [
    (dict(cp=2, cp_method="ring-zigzag"), 8, "cover cp_method 'ring-zigzag'"), (dict(dp=2, zero=1), 8, "cover zero"),
    (dict(micro_batches=3), 24, "micro_batches = 3"), (dict(dp=2), 12, "batch rows = 12")])
def test_refused_before_launch(dims, batch, words):
    bad = dataclasses.replace(recipe(), batches=[(x[:1].expand(batch, -1), y[:1].expand(batch, -1))
                                                 for x, y in recipe().batches])
    with pytest.raises(ValueError, match=words):
        validate(bad, invariant=True, **{"micro_batches": 1, **dims})


def test_tree_sum_chunks_are_subtrees():
    """The principle on one sum: 4 ranks' partial trees, completed by the tree over ranks, are one device's
    tree bit for bit; a running sum (a ring's or a loop's order) is not, for these numbers."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0)) * torch.logspace(0, 6, 1024)
    partials = torch.stack([canonical.tree_sum(c) for c in x.chunk(4)])
    assert torch.equal(canonical.tree_sum(partials), canonical.tree_sum(x))
    running = torch.zeros(())
    for v in x:
        running = running + v
    assert not torch.equal(running, canonical.tree_sum(x))


def test_mode_is_scoped():
    """minipar.invariant() is the context manager, its module minipar.invariant_mode; the mode (and its cp
    group) hold inside the block only."""
    assert minipar.invariant is invariant_mode.invariant and not invariant_mode.active()
    with minipar.invariant(cp_group="a group"):
        assert invariant_mode.active() and invariant_mode.cp_group() == "a group"
        with minipar.invariant(False, cp_group="a group"):
            assert not invariant_mode.active() and invariant_mode.cp_group() is None
        assert invariant_mode.active()
    assert not invariant_mode.active() and invariant_mode.cp_group() is None

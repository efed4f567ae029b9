"""HSDP and the hierarchical all-reduce (issue 39): on ranks declared as 2 nodes, each mode trains as one device
does (float64), and the bytes its sends carried across the node boundary equal the formulas — HSDP's and the
hierarchical all-reduce's below flat FSDP's and the flat ring's by the formulas' factors."""
import pytest
import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.data import hsdp


def recipe():
    r = gpt_recipe(steps=2, batch_size=8, seq_len=16)
    r.dtype = torch.float64
    return r


@pytest.fixture(scope="module")
def reference():
    return train_reference(recipe())


def _every_mode(rank, world_size, recipe, per_node):
    """The four modes one after another on this rank: one launch for all (what hsdp.run launches for one)."""
    return {mode: hsdp.parallel_train(rank, world_size, recipe, per_node=per_node, mode=mode) for mode in hsdp.MODES}


@pytest.mark.parametrize("world_size, per_node", [(4, 2), (8, 4)])
def test_every_mode_equals_one_device_and_its_cross_node_bytes_are_the_formula(reference, world_size, per_node):
    from minipar.launcher import launch
    S = sum(p.numel() for p in recipe().model().parameters()) * 8
    n = world_size // per_node
    for mode in hsdp.MODES:
        hsdp.validate(recipe(), world_size=world_size, per_node=per_node, mode=mode)
    per_rank = launch(_every_mode, world_size, recipe(), per_node, quiet=True)
    cross = {}
    for mode in hsdp.MODES:
        runs = [r[mode] for r in per_rank]
        compare(reference, runs, dtype=torch.float64).assert_ok()
        cross[mode] = sum(r.cross_node[-1] for r in runs)
        assert cross[mode] == pytest.approx(hsdp.CROSS_NODE_FORMULAS[mode](S, world_size, n), rel=0.01), mode
        if mode == "hsdp":
            assert runs[0].param_bytes == pytest.approx(S / per_node, rel=0.01)      # a node's shard, not 1/N
    N = world_size
    assert cross["hsdp"] < cross["fsdp"] and cross["ddp hierarchical"] < cross["ddp"]
    assert cross["fsdp"] / cross["hsdp"] == pytest.approx(n * 3 * (N - 1) / N / (2 * (n - 1)), rel=0.01)


def test_hierarchical_all_reduce_is_the_sum():
    from minipar.launcher import launch
    results = launch(_sum, 4, quiet=True)
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(results[0], sum(torch.arange(7.0) * (k + 1) for k in range(4)))


def _sum(rank, world_size):
    node, cross = hsdp.node_groups(world_size, 2)
    t = torch.arange(7.0) * (rank + 1)                          # 7 elements: padded to the node's 2 shards
    return hsdp.hierarchical_all_reduce(t, node, cross)


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=4, per_node=4, mode="hsdp"), "two or more nodes"),
    (dict(world_size=6, per_node=4, mode="hsdp"), "two or more nodes"),
    (dict(world_size=4, per_node=2, mode="zero"), "mode must be one of"),
    (dict(world_size=4, per_node=0, mode="hsdp"), "per_node must be a positive integer"),
])
def test_bad_layouts_are_refused_before_any_process_starts(monkeypatch, kwargs, words):
    monkeypatch.setattr("minipar.data.hsdp.launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match=words):
        hsdp.run(recipe(), **kwargs)

"""ZeRO++ (Wang et al. 2023; issue 41): qwZ, hpZ and qgZ on 4 ranks declared as 2 nodes of 2 equal their own
rule run in one process (float64: observed max |Δ| = 0), are not ZeRO-3 (quantization changes the numbers),
and send the bytes of the formulas, in all and across the node boundary; quantization errs by at most s/2."""
import pytest
import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.data import int8_blocks, zeropp
from minipar.launcher import launch

CONFIGS = {
    "ZeRO-3": dict(qwz=False, hpz=False, qgz=False),
    "qwZ": dict(qwz=True, hpz=False, qgz=False),
    "hpZ": dict(qwz=False, hpz=True, qgz=False),
    "qgZ": dict(qwz=False, hpz=False, qgz=True),
    "ZeRO++": dict(qwz=True, hpz=True, qgz=True),
}
WORLD, PER_NODE, BLOCK = 4, 2, 256


def recipe():
    r = gpt_recipe(steps=2, batch_size=8, seq_len=16)     # 2 steps: the rule's Adam state is used from step 2
    r.dtype = torch.float64
    return r


def _every_config(rank, world_size, recipe):
    return {name: zeropp.parallel_train(rank, world_size, recipe, per_node=PER_NODE, block=BLOCK, **flags)
            for name, flags in CONFIGS.items()}


@pytest.fixture(scope="module")
def runs():
    """{config: per-rank ZeroPPRun}, every configuration in one launch."""
    per_rank = launch(_every_config, WORLD, recipe(), quiet=True)
    return {name: [r[name] for r in per_rank] for name in CONFIGS}


@pytest.fixture(scope="module")
def rules():
    """{config: its rule run in one process}, each computed once for the tests that read it."""
    return {name: zeropp.zeropp_reference(recipe(), WORLD, qwz=flags["qwz"], qgz=flags["qgz"], block=BLOCK)
            for name, flags in CONFIGS.items()}


@pytest.fixture(scope="module")
def one_device():
    return train_reference(recipe())


def test_every_configuration_equals_its_own_rule(runs, rules, one_device):
    for name in CONFIGS:
        c = compare(rules[name], runs[name], atol=1e-12, rtol=1e-12, dtype=torch.float64)
        assert c.matches, (name, str(c))
    compare(one_device, runs["ZeRO-3"], dtype=torch.float64).assert_ok()   # all off: one device


def test_zeropp_is_not_zero3_so_the_check_can_fail(runs, rules, one_device):
    rule = rules["ZeRO++"]
    assert not compare(rule, runs["ZeRO-3"], dtype=torch.float64).matches
    against_one_device = compare(one_device, runs["ZeRO++"], dtype=torch.float64)
    assert not against_one_device.matches
    assert 1e-6 < against_one_device.loss_diffs[-1] < 0.1                  # a gap, and a small one


def test_bytes_in_all_and_across_nodes_are_the_formulas(runs):
    padded = [layout.padded_numel for _, layout in zeropp.flat_units(recipe().model(), WORLD)]
    assert padded == [12704, 12704, 5184]                # 2 blocks, the root: each a multiple of 4 shards
    cross, steps = {}, recipe().steps
    for name, flags in CONFIGS.items():
        sent, across = zeropp.step_bytes(padded, WORLD, PER_NODE, 8, block=BLOCK, **flags)
        for r in runs[name]:
            assert r.sent == [sent] * steps, name
        cross[name] = [sum(r.cross_node[s] for r in runs[name]) for s in range(steps)]
        assert cross[name] == [across] * steps, name
        held = 8 * sum(padded) // PER_NODE if flags["hpz"] else 0             # hpZ's secondary: Ψ/g per rank
        assert all(r.secondary_bytes == held for r in runs[name]), name
    assert cross["ZeRO++"][0] < min(cross[n][0] for n in ("qwZ", "hpZ", "qgZ")) < cross["ZeRO-3"][0]
    # hpZ: the backward's all-gather stays inside the node, one of ZeRO-3's three crossings
    assert cross["hpZ"][0] / cross["ZeRO-3"][0] == pytest.approx(2 / 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numel, block", [(1000, 256), (7, 1), (300, 300), (513, 64)])
def test_quantize_dequantize_errs_by_at_most_half_a_step(dtype, numel, block):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel), dtype=torch.float64).to(dtype) * 3
    if numel > block:
        x[:block] = 0                                                     # a block of zeros: s = 0, exact
    q, scales = int8_blocks.quantize_int8(x, block)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and len(scales) == -(-numel // block)
    assert int(q.abs().max()) <= 127
    back = int8_blocks.dequantize_int8(q, scales, block, dtype)
    s = scales.double().repeat_interleave(block)[:numel]
    rounding = torch.finfo(dtype).eps * x.double().abs()                  # the dtype's own rounding
    assert bool(((x.double() - back.double()).abs() <= s / 2 + rounding).all())
    message = int8_blocks.pack(q, scales)                                      # the bytes on the wire
    assert message.numel() == numel + 4 * len(scales)
    assert torch.equal(int8_blocks.unpack(message, numel, block, dtype), back)


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=4, per_node=2, block=0), "block must be a positive integer"),
    (dict(world_size=6, per_node=4), "two or more nodes"),
    (dict(world_size=4, per_node=4), "two or more nodes"),
    (dict(world_size=4, per_node=0), "per_node must be a positive integer"),
])
def test_bad_configurations_are_refused_before_any_process_starts(monkeypatch, kwargs, words):
    monkeypatch.setattr("minipar.data.zeropp.launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match=words):
        zeropp.run(recipe(), **kwargs)


def test_tour_row_equals_its_rule_and_its_wire_bytes_are_the_formula():
    from minipar.course import tour
    from minipar.course.ch03_zero_and_fsdp.zeropp_row import zeropp_row
    row = zeropp_row()
    assert row.matches and row.kind == "update rule", row
    assert row.bytes_sent_per_rank == row.bytes_formula
    assert tour.observed_status(row) in ("within", None), row          # None off Linux: nothing observed
    assert "×5.06 less" in row.note                    # across nodes: 3·n(N−1)·4S ÷ (n(N−1)·c + N(N−g)·c)

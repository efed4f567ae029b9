"""Expert-choice routing (Zhou et al. 2022) beside token choice: every expert takes exactly its top C tokens with
gates p_te, the layer equals a brute-force sum, and expert parallelism (ep 4; ep 2 × dp 2) equals one device
routing in the ranks' groups, in float64."""
import pytest
import torch

from minipar.check import compare, train_reference
from minipar.models import GPTConfig
from minipar.moe import expert_parallel as epm
from minipar.moe.layer import MoEConfig, MoELayer, moe_recipe
from minipar.moe.router import route_expert_choice

F64 = torch.float64


def test_every_expert_takes_its_top_c_tokens():
    torch.manual_seed(0)
    logits = torch.randn(12, 4, dtype=F64)
    r = route_expert_choice(logits, capacity_factor=2.0)            # C = ⌈12/4·2⌉ = 6
    probs = logits.softmax(-1)
    assert r.capacity == 6 and r.load().tolist() == [6] * 4 and r.expert.shape == (12, 4)
    for e in range(4):
        chosen = r.kept[:, e].nonzero().flatten()
        assert set(chosen.tolist()) == set(probs[:, e].topk(6).indices.tolist())
        assert sorted(r.slot[chosen, e].tolist()) == list(range(6))
    assert torch.equal(r.gate, probs)


def test_layer_equals_the_brute_force_sum():
    cfg = GPTConfig(n_embd=8, n_head=2, n_layer=1)
    layer = MoELayer(cfg, MoEConfig(experts=4, capacity_factor=1.0, expert_choice=True)).double()
    x = torch.randn(16, 8, dtype=F64)
    y = layer(x)
    probs = layer.router(x).softmax(-1)
    want = torch.zeros_like(x)
    for e, expert in enumerate(layer.experts):
        for t in probs[:, e].topk(4).indices:                   # C = 16/4
            want[t] += probs[t, e] * expert(x[t])
    assert torch.allclose(y, want, atol=1e-12) and float(layer.aux_loss) == 0.0


@pytest.mark.parametrize("ep", [4, 2])
def test_expert_parallel_equals_one_device_routing_in_the_ranks_groups(ep):
    recipe = moe_recipe(steps=3, batch_size=8, dtype=F64, experts=4, capacity_factor=1.0, groups=4, expert_choice=True)
    compare(train_reference(recipe), epm.run(recipe, world_size=4, ep=ep), dtype=F64).assert_ok()


def test_expert_choice_refuses_dropless_and_a_bias():
    for extra in ({"dropless": True}, {"bias_rate": 1e-3}):
        with pytest.raises(ValueError, match="expert choice fills every expert"):
            MoEConfig(expert_choice=True, **extra)

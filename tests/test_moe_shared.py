"""Shared and fine-grained experts (DeepSeekMoE): the layer's output by its formula, the parameter budget of
fine-grained segmentation, and expert parallelism equal to one device with both."""
import pytest
import torch

from minipar.check import compare, train_reference
from minipar.models import FeedForward, GPTConfig
from minipar.moe import expert_parallel as epm
from minipar.moe.layer import MoEConfig, MoEGPT, MoELayer, combine, moe_recipe, no_drop_capacity_factor

CFG = GPTConfig(n_embd=8, n_head=2)          # ffn_mult 4: dense FFN hidden 32


def test_layer_output_is_shared_experts_plus_routed_experts():
    layer = MoELayer(CFG, MoEConfig(experts=4, k=2, capacity_factor=2.0, shared=2, granularity=2)).double()
    assert [e.fc.out_features for e in layer.experts] == [16] * 4 and len(layer.shared) == 2
    x = torch.randn(10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = layer(x)
    r = layer.routing
    buffer = torch.zeros(4, r.capacity, 8, dtype=torch.float64)
    for t in range(10):
        for j in range(2):
            if r.kept[t, j]:
                buffer[r.expert[t, j], r.slot[t, j]] = x[t]
    routed = combine(torch.stack([layer.experts[e](buffer[e]) for e in range(4)]), r, 10)
    want = routed + layer.shared[0](x) + layer.shared[1](x)
    assert torch.allclose(y, want, rtol=0, atol=1e-14)


def test_a_token_dropped_by_every_expert_still_gets_the_shared_experts():
    layer = MoELayer(CFG, MoEConfig(experts=2, k=1, capacity_factor=0.5, shared=1)).double()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 10.0
    x = torch.rand(12, 8, dtype=torch.float64) + 0.1
    y = layer(x)
    dropped = (~layer.routing.kept[:, 0]).nonzero().flatten()
    assert len(dropped) == 9 and torch.allclose(y[dropped], layer.shared[0](x[dropped]), rtol=0, atol=1e-15)


def test_fine_grained_segmentation_keeps_the_expert_weights_and_the_compute():
    def expert_weights(moe):
        layer = MoELayer(CFG, moe)
        return sum(p.numel() for n, p in layer.named_parameters() if n.startswith("experts") and n.endswith("weight"))
    coarse, fine = MoEConfig(experts=4, k=1), MoEConfig(experts=8, k=2, granularity=2)
    assert expert_weights(coarse) == expert_weights(fine) == 4 * 2 * 8 * 32
    # per token: k experts of hidden H/m each -> k·H/m hidden units, the same 32 for both
    assert coarse.k * CFG.ffn_hidden // coarse.granularity == fine.k * CFG.ffn_hidden // fine.granularity


def test_defaults_add_nothing():
    model = MoEGPT(GPTConfig(), MoEConfig())
    assert not any(".shared." in n for n, _ in model.named_parameters())
    assert isinstance(model.moe_layers()[0].experts[0], FeedForward)


@pytest.mark.parametrize("bad,says", [({"granularity": 3}, "must divide ffn_mult"), ({"shared": -1}, "≥ 0"),
                                      ({"granularity": 0}, "granularity")])
def test_bad_shapes_are_refused(bad, says):
    with pytest.raises(ValueError, match=says):
        MoELayer(CFG, MoEConfig(experts=4, **bad))


@pytest.mark.parametrize("ep", [4, 2])
def test_expert_parallel_with_shared_and_fine_grained_experts_equals_one_device(ep):
    recipe = moe_recipe(steps=2, batch_size=8, experts=8, k=2, shared=1, granularity=2,
                        capacity_factor=no_drop_capacity_factor(8, 2), dtype=torch.float64)
    reference = train_reference(recipe)
    assert any(".shared.0." in n for n in reference.params)
    compare(reference, epm.run(recipe, world_size=4, ep=ep), dtype=torch.float64).assert_ok()


def test_the_hybrid_trainer_places_shared_fine_grained_and_loss_free_experts():
    """Accepted (tests/test_parallel5d_dropless.py trains them against one device); loss-free only with one
    micro-batch per step, whose load moves the bias."""
    from minipar.hybrid.experts import validate
    from minipar.layout import Layout
    for extra in ({"shared": 1}, {"granularity": 2}, {"bias_rate": 1e-3}, {"dropless": True}):
        model = MoEGPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=32),
                       MoEConfig(experts=4, **extra))
        validate(Layout(dp=2, ep=2, micro_batches=1), model)
    with pytest.raises(ValueError, match="with micro_batches > 1"):
        validate(Layout(dp=2, ep=2, micro_batches=2), model_with(bias_rate=1e-3))


def model_with(**extra):
    return MoEGPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=32), MoEConfig(experts=4, **extra))

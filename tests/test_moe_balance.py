"""Router z-loss, sequence-wise vs batch-wise balance loss, and loss-free balancing, against hand-computed values."""
import math

import pytest
import torch

from minipar.check import gpt_recipe
from minipar.models import GPTConfig
from minipar.moe import expert_parallel as epm
from minipar.moe.balance import batch_balance_loss, sequence_balance_loss, update_bias, z_loss
from minipar.moe.layer import MoEConfig, MoEGPT, MoELayer, moe_recipe
from minipar.moe.router import load_balancing_loss, route

LN2 = math.log(2.0)


def test_z_loss_by_hand():
    # logsumexp of (0, 0) is ln 2, of (ln 3, 0) is ln 4 = 2 ln 2: mean of squares (1 + 4)/2 · ln²2
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    assert z_loss(logits, weight=1e-3).item() == pytest.approx(1e-3 * 2.5 * LN2 ** 2, rel=1e-12)
    assert z_loss(logits + 100, weight=1.0) > 1e3 * z_loss(logits, weight=1.0)   # large logits: large loss


def test_z_loss_joins_the_layers_aux_loss():
    cfg = GPTConfig(n_embd=8, n_head=2)
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    plain = MoELayer(cfg, MoEConfig(experts=4)).double()
    with_z = MoELayer(cfg, MoEConfig(experts=4, z_loss=0.5)).double()
    with_z.load_state_dict(plain.state_dict())
    plain(x), with_z(x)
    want = plain.aux_loss + 0.5 * plain.router(x).logsumexp(-1).pow(2).mean()
    assert with_z.aux_loss.item() == pytest.approx(want.item(), rel=1e-12)


# Two sequences of two tokens, E = 2, top-1: sequence A sends both tokens to expert 0, sequence B both to 1.
PROBS = torch.tensor([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.1, 0.9]], dtype=torch.float64)
EXPERT = torch.tensor([[0], [0], [1], [1]])


def test_sequence_wise_loss_by_hand():
    # A: f = 2/(1·2)·(2, 0) = (2, 0), P = (0.7, 0.3): 1.4.   B: f = (0, 2), P = (0.2, 0.8): 1.6.   mean 1.5
    assert sequence_balance_loss(PROBS, EXPERT, seq_len=2, alpha=0.1).item() == pytest.approx(0.15, rel=1e-12)


def test_batch_wise_loss_by_hand_sees_a_balanced_batch():
    # the batch: f = 2/4·(2, 2) = (1, 1), P = (0.45, 0.55): 1.0 — the value of perfect balance
    assert batch_balance_loss(PROBS, EXPERT, alpha=0.1).item() == pytest.approx(0.1, rel=1e-12)


def test_top_k_counts_every_choice_divided_by_k():
    # one sequence of 2 tokens, E = 4, top-2: choices (0, 1) and (0, 2): f = 4/(2·2)·(2, 1, 1, 0) = (2, 1, 1, 0)
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.5, 0.1, 0.3, 0.1]], dtype=torch.float64)
    expert = torch.tensor([[0, 1], [0, 2]])
    want = 2 * 0.45 + 1 * 0.2 + 1 * 0.25 + 0 * 0.1
    assert batch_balance_loss(probs, expert, alpha=1.0).item() == pytest.approx(want, rel=1e-12)


def test_batch_wise_top1_is_switchs_loss():
    logits = torch.randn(32, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    r = route(logits)
    assert batch_balance_loss(r.probs, r.expert, 0.01).item() == pytest.approx(
        load_balancing_loss(r, alpha=0.01).item(), rel=1e-12)
    with pytest.raises(ValueError, match="sequences of 5"):
        sequence_balance_loss(r.probs, r.expert, seq_len=5, alpha=0.01)


# ---- loss-free balancing ------------------------------------------------------------------------------------

def test_bias_update_rule_by_hand():
    bias = torch.zeros(4)
    update_bias(bias, torch.tensor([6, 2, 0, 0]), rate=0.1)        # mean 2: over, even, under, under
    assert bias.tolist() == pytest.approx([-0.1, 0.0, 0.1, 0.1])


def test_bias_chooses_but_never_enters_the_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 4, dtype=torch.float64, generator=g).requires_grad_()
    bias = torch.tensor([0.5, 0.0, -0.5, 0.0], dtype=torch.float64, requires_grad=True)
    weights = torch.randn(16, 2, dtype=torch.float64, generator=g)
    r = route(logits, k=2, capacity_factor=2.0, bias=bias)
    assert not torch.equal(r.expert, route(logits, k=2, capacity_factor=2.0).expert)   # the bias changed choices
    (r.gate * weights).sum().backward()
    assert bias.grad is None                                              # not in the graph at all
    # the gradient is that of the unbiased probabilities at the experts the bias chose
    ref = logits.detach().clone().requires_grad_()
    top = ref.softmax(-1).gather(-1, r.expert)
    ((top / top.sum(-1, keepdim=True)) * weights).sum().backward()
    assert torch.allclose(logits.grad, ref.grad, rtol=0, atol=1e-15)


def test_layer_bias_is_a_buffer_not_a_parameter():
    cfg = GPTConfig(n_embd=8, n_head=2)
    layer = MoELayer(cfg, MoEConfig(experts=4, bias_rate=0.01))
    assert "routing_bias" in dict(layer.named_buffers())
    assert not any("routing_bias" in n for n, _ in layer.named_parameters())
    assert "routing_bias" not in dict(MoELayer(cfg, MoEConfig(experts=4)).named_buffers())   # off: no buffer


def test_bias_evens_the_load_of_a_skewed_router():
    # fixed logits favouring expert 0: only the bias moves, as in the first steps of training
    logits = torch.randn(256, 4, generator=torch.Generator().manual_seed(1)) + torch.tensor([1.5, 0.0, 0.0, 0.0])
    bias = torch.zeros(4)
    before = route(logits).wanted()
    for _ in range(100):
        update_bias(bias, route(logits, bias=bias).wanted(), rate=0.01)
    after = route(logits, bias=bias).wanted()
    assert before.max() > 2 * 64 and after.max() < 1.2 * 64          # fair share 256/4 = 64
    assert bias[0] < 0 < bias[1:].min()


def test_model_updates_every_layers_bias_after_a_step():
    recipe = gpt_recipe(steps=1)
    model = MoEGPT(recipe.model().cfg, MoEConfig(experts=4, bias_rate=0.01))
    x, y = recipe.batches[0]
    model(x)
    loads = [layer.routing.wanted() for layer in model.moe_layers()]
    model.update_routing_bias()
    for layer, load in zip(model.moe_layers(), loads):
        assert torch.equal(layer.routing_bias, 0.01 * torch.sign(load.float().mean() - load.float()))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="bias_rate must be ≥ 0"):
        MoEConfig(bias_rate=-1.0)
    with pytest.raises(ValueError, match="z_loss must be ≥ 0"):
        MoEConfig(z_loss=-1e-3)
    recipe = moe_recipe(steps=1)
    cfg = recipe.model().cfg
    recipe.model = lambda: MoEGPT(cfg, MoEConfig(experts=4, bias_rate=0.01))
    with pytest.raises(ValueError, match="use micro_batches=1"):
        epm.validate(recipe, world_size=2, ep=2, micro_batches=2)


def test_loss_free_balancing_under_expert_parallelism_equals_one_device():
    """Issue 36: every rank moves its copy of the bias from the whole batch's load (its choices all-reduced over
    the data-parallel ranks), as one device moves its bias after each step; float64, no-drop capacity, no aux
    loss (alpha 0: the bias alone balances), 4 ranks, ep 2 and 4."""
    from minipar.check import compare
    from minipar.moe.expert_parallel import loss_free_reference
    recipe = moe_recipe(steps=4, batch_size=8, experts=4, k=1, capacity_factor=4.0, alpha=0.0, dtype=torch.float64)
    cfg = recipe.model().cfg
    recipe.model = lambda: MoEGPT(cfg, MoEConfig(experts=4, k=1, capacity_factor=4.0, alpha=0.0, bias_rate=0.05))
    reference, biases = loss_free_reference(recipe)
    assert any(b.abs().sum() > 0 for b in biases)                    # the bias really moved
    for ep in (2, 4):
        compare(reference, epm.run(recipe, world_size=4, ep=ep), dtype=torch.float64).assert_ok()

"""The router on one process: capacity, which tokens are dropped (and that they pass through the residual),
top-k priority and gates, the Switch load-balancing loss against its formula, and the MoE layer against a
token-by-token loop."""
import math

import pytest
import torch

from minipar.models import GPTConfig
from minipar.moe.layer import MoEConfig, MoEGPT, MoELayer, combine, dispatch, moe_recipe, validate_config
from minipar.moe.router import (balance_counts, capacity, deepspeed_aux, gshard_paper_aux,
                                load_balancing_loss, route)


def logits_for(choices, experts, strength=5.0):
    """Logits whose top choice per token is ``choices[t]`` (a list of expert lists, most preferred first)."""
    out = torch.zeros(len(choices), experts, dtype=torch.float64)
    for t, prefs in enumerate(choices):
        for rank, e in enumerate(prefs):
            out[t, e] = strength * (len(prefs) - rank)
    return out


@pytest.mark.parametrize("tokens,experts,cf,k,want", [
    (16, 4, 1.0, 1, 4), (16, 4, 1.25, 1, 5), (10, 4, 1.0, 1, 3), (16, 4, 1.0, 2, 8), (32, 8, 1.5, 2, 12),
    (7, 4, 0.1, 1, 1)])
def test_capacity_is_ceil_k_tokens_over_experts_times_cf(tokens, experts, cf, k, want):
    assert capacity(tokens, experts, cf, k) == want == max(1, math.ceil(k * tokens / experts * cf))


def test_top1_drops_the_latest_tokens_of_a_full_expert_and_counts_them():
    # 8 tokens, 2 experts, capacity ceil(8/2 * 0.75) = 3: expert 0 wanted by tokens 0,1,2,4,6,7
    choices = [[0], [0], [0], [1], [0], [1], [0], [0]]
    r = route(logits_for(choices, 2), k=1, capacity_factor=0.75)
    assert r.capacity == 3
    assert r.expert[:, 0].tolist() == [c[0] for c in choices]
    assert r.slot[:, 0].tolist() == [0, 1, 2, 0, 3, 1, 4, 5]
    assert (~r.kept[:, 0]).nonzero().flatten().tolist() == [4, 6, 7]       # first come, first served
    assert r.dropped == 3
    assert r.wanted().tolist() == [6, 2] and r.load().tolist() == [3, 2]
    assert torch.allclose(r.gate[:, 0], r.probs.max(dim=-1).values)       # Switch: the gate is p, unnormalised


def test_top2_first_choices_before_second_choices_and_gates_sum_to_one():
    # 4 tokens, 3 experts, capacity ceil(2*4/3*0.75) = 2
    choices = [[0, 1], [1, 0], [0, 2], [2, 0]]
    r = route(logits_for(choices, 3), k=2, capacity_factor=0.75)
    assert r.capacity == 2
    # expert 0: first choices of tokens 0 and 2 take slots 0, 1; second choices of tokens 1 and 3 come after
    # (slots 2, 3: dropped); expert 1: token 1's first choice, then token 0's second
    assert r.slot.tolist() == [[0, 1], [0, 2], [1, 1], [0, 3]]
    assert r.kept.tolist() == [[True, True], [True, False], [True, True], [True, False]]
    assert r.dropped == 2
    assert torch.allclose(r.gate.sum(-1), torch.ones(4, dtype=torch.float64))


def test_dropped_tokens_pass_through_the_residual():
    cfg = GPTConfig(n_embd=8, n_head=2)
    layer = MoELayer(cfg, MoEConfig(experts=2, k=1, capacity_factor=0.5)).double()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 10.0                  # every token with x[0] > 0 prefers expert 0
    x = torch.randn(12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).abs()
    y = layer(x)
    r = layer.routing
    assert r.capacity == 3 and r.dropped == 9
    dropped = (~r.kept[:, 0]).nonzero().flatten()
    assert dropped.tolist() == list(range(3, 12))
    assert torch.equal(y[dropped], torch.zeros_like(y[dropped]))            # the layer adds nothing ...
    block_out = x + y
    assert torch.equal(block_out[dropped], x[dropped])                      # ... x + 0: the residual carries them


def test_aux_loss_equals_its_formula():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(20, 4, dtype=torch.float64, generator=g)
    r = route(logits, k=2, capacity_factor=1.0)
    probs = logits.softmax(-1)
    first = logits.argmax(-1)
    f = [sum(1 for t in range(20) if first[t] == i) / 20 for i in range(4)]
    P = [probs[:, i].mean().item() for i in range(4)]
    want = 0.01 * 4 * sum(fi * pi for fi, pi in zip(f, P))
    assert load_balancing_loss(r, alpha=0.01).item() == pytest.approx(want, rel=1e-12)
    assert balance_counts(r).tolist() == [20 * fi for fi in f]
    # GShard's paper and fairscale's mean(me*ce) are E^2 smaller; DeepSpeed's/fairseq's mean(me*ce)*E*E equals Switch's
    switch = load_balancing_loss(r, alpha=1.0)
    assert deepspeed_aux(r).item() == pytest.approx(switch.item(), rel=1e-12)
    assert (gshard_paper_aux(r) * 16).item() == pytest.approx(switch.item(), rel=1e-12)


def test_aux_loss_is_alpha_when_balanced_and_larger_when_not():
    uniform = route(torch.zeros(8, 4, dtype=torch.float64) + torch.eye(4, dtype=torch.float64).repeat(2, 1) * 1e-3)
    assert load_balancing_loss(uniform, alpha=0.01).item() == pytest.approx(0.01, rel=1e-3)
    skewed = route(logits_for([[0]] * 8, 4))
    assert load_balancing_loss(skewed, alpha=0.01).item() > 0.035      # ~ alpha * E * p_0 with p_0 near 1


def test_aux_loss_gradient_pushes_probability_off_the_busy_expert():
    logits = logits_for([[0]] * 6 + [[1]] * 2, 4, strength=1.0).requires_grad_()
    load_balancing_loss(route(logits), alpha=1.0).backward()
    # gradient descent lowers the logit of the most loaded expert (positive gradient on it)
    assert logits.grad[:, 0].mean() > 0 > logits.grad[:, 2].mean()


def loop_moe(layer, x):
    """The MoE layer token by token, choice by choice: the definition."""
    r = route(layer.router(x), layer.moe.k, layer.moe.capacity_factor)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(layer.moe.k):
            if r.kept[t, j]:
                out[t] = out[t] + r.gate[t, j] * layer.experts[int(r.expert[t, j])](x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("k,cf", [(1, 1.0), (2, 0.75), (2, 2.0), (1, 0.5)])
def test_moe_layer_equals_the_token_loop_forward_and_backward(k, cf):
    cfg = GPTConfig(n_embd=8, n_head=2)
    torch.manual_seed(0)
    layer = MoELayer(cfg, MoEConfig(experts=4, k=k, capacity_factor=cf)).double()
    x = torch.randn(24, 8, dtype=torch.float64, requires_grad=True)
    got = layer(x)
    want = loop_moe(layer, x)
    assert torch.allclose(got, want, atol=1e-12)
    params = [x] + list(layer.parameters())
    g1 = torch.autograd.grad(got.square().sum(), params, allow_unused=True)
    g2 = torch.autograd.grad(want.square().sum(), params, allow_unused=True)
    for p, a, b in zip(params, g1, g2):   # an expert no token reached: None in the loop, zeros in the buffer
        a, b = (torch.zeros_like(p) if g is None else g for g in (a, b))
        assert torch.allclose(a, b, atol=1e-12)


def test_dispatch_buffer_layout_and_combine_inverse():
    r = route(logits_for([[1], [0], [1], [1]], 2), capacity_factor=1.0)   # C = 2: token 3 dropped
    x = torch.arange(4, dtype=torch.float64).unsqueeze(-1) + 1            # tokens 1, 2, 3, 4
    buf = dispatch(x, r)
    assert buf.squeeze(-1).tolist() == [[2.0, 0.0], [1.0, 3.0]]          # expert 0: token 1; expert 1: 0, 2
    back = combine(buf, r, 4)
    assert torch.allclose(back.squeeze(-1), x.squeeze(-1) * r.gate[:, 0] * r.kept[:, 0])


@pytest.mark.parametrize("bad,reason", [
    (dict(experts=4, k=5), "top-k"), (dict(experts=4, capacity_factor=0.0), "capacity factor"),
    (dict(experts=4, capacity_factor=-1.0), "capacity factor"), (dict(experts=0), "at least one expert")])
def test_bad_configurations_are_refused(bad, reason):
    with pytest.raises(ValueError, match=reason):
        MoEConfig(**bad)


def test_experts_not_divisible_by_ep_refused():
    with pytest.raises(ValueError, match="divisible by the EP size"):
        validate_config(MoEConfig(experts=6), ep=4)


def test_moe_gpt_trains_and_reports_aux_loss():
    recipe = moe_recipe(steps=2, batch_size=4, experts=4, k=2)
    model = recipe.model()
    assert isinstance(model, MoEGPT) and len(model.moe_layers()) == model.cfg.n_layer
    x, y = recipe.batches[0]
    loss = recipe.loss(model, x, y)
    aux = model.aux_loss()
    assert 0 < aux.item() < 1 and loss.item() > aux.item()
    loss.backward()
    assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0
    # deterministic from the seed
    assert all(torch.equal(a, b) for a, b in zip(recipe.model().parameters(), model.parameters()))


def test_route_groups_equals_routing_each_group_alone():
    from minipar.moe.router import route_groups
    logits = torch.randn(24, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    logits[:, 0] += 1.0
    whole = route_groups(logits, 3, k=2, capacity_factor=1.0)
    c = capacity(8, 4, 1.0, 2)
    assert whole.capacity == 3 * c
    for g in range(3):
        alone = route(logits[8 * g: 8 * (g + 1)], k=2, capacity_factor=1.0)
        rows = slice(8 * g, 8 * (g + 1))
        assert torch.equal(whole.kept[rows], alone.kept)
        assert torch.equal(whole.slot[rows][alone.kept], alone.slot[alone.kept] + g * c)
    assert whole.dropped == sum(route(x, 2, 1.0).dropped for x in logits.chunk(3)) > 0
    assert route(logits, 2, 1.0).dropped != whole.dropped      # one group of 24 drops other tokens
    with pytest.raises(ValueError, match="equal routing groups"):
        route_groups(logits, 5)

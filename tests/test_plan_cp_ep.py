"""minipar.plan with context parallelism (every chapter-06b method) and expert parallelism (an MoE model):
each term against the formula the chapters measure."""
from types import SimpleNamespace

import pytest

from minipar.data import zero_memory
from minipar.hybrid.context import cp_bytes
from minipar.moe.expert_parallel import predicted_all_to_all_bytes
from minipar.plan import (Layout, MoETransformer, Transformer, a100_cluster, estimate,
                          expert_parameters, forward_flops, layer_parameters, layouts, parameters, plan,
                          stage_parameters, validate)
from minipar.plan.traffic import dim_link

CLUSTER = a100_cluster(2)
DENSE = Transformer(layers=4, hidden=64, heads=8, vocab=128, seq_len=64)
MOE = MoETransformer(layers=4, hidden=64, heads=8, vocab=128, seq_len=64, experts=8, k=2, capacity_factor=1.25)
FP32 = dict(precision="fp32", dropout=False)


# Calls per layer and micro-batch, counted by hand from the chapter-06b code (cp = 4), forward + backward:
# ring attention (minipar/sequence/ring_attention.py): K, V passed cp−1 = 3 times forward; backward K, V cp−1
# = 3 times and dK, dV cp = 4 times: 3 + 7 = 10 messages (the tour's cp-ring row counts 10 on the wire), each of
# one K+V (or dK+dV) block pair; full recomputation runs the forward's 3 again: 13. RSA (ring_self_attention.py)
# passes K, V 3 times forward and 2·3 = 6 backward: 9, recomputed 12. Ulysses (ulysses.py): forward seq_to_heads
# of Q, K, V and heads_to_seq of O, 4 all-to-alls; backward each one's gradient, 4 more: 8, recomputed 12.
CP_CALLS = {("ring", "none"): 10, ("ring", "full"): 13, ("ring-zigzag", "none"): 10, ("ring-zigzag", "full"): 13,
            ("rsa", "none"): 9, ("rsa", "full"): 12, ("ulysses", "none"): 8, ("ulysses", "full"): 12}


@pytest.mark.parametrize("method", ["ring", "ring-zigzag", "ulysses", "rsa"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_cp_bytes_and_seconds_are_the_methods_calls_counted_by_hand(method, recompute):
    layout = Layout(dp=2, cp=4, cp_method=method, recompute=recompute, micro_batch=2, micro_batches=3)
    e = estimate(DENSE, CLUSTER, layout, **FP32)
    calls = CP_CALLS[method, recompute] * 4 * 3                     # × 4 layers × 3 micro-batches
    block = 2 * 16 * 64 * 4                                         # b · s/cp · h · 4 bytes = 8 KiB
    alpha, beta = CLUSTER.intra_latency, CLUSTER.intra_bw           # the 4 cp ranks share a node
    if method == "ulysses":     # an all-to-all keeps 1/cp of the block and sends the rest, in cp−1 messages
        assert e.bytes_sent["cp"] == pytest.approx(calls * 3 / 4 * block)
        assert e.time["cp"] == pytest.approx(calls * (3 * alpha + 3 / 4 * block / beta))
    else:                       # one message of two blocks per pass
        assert e.bytes_sent["cp"] == calls * 2 * block
        assert e.time["cp"] == pytest.approx(calls * (alpha + 2 * block / beta))
    assert e.bytes_sent["cp"] == cp_bytes(SimpleNamespace(n_embd=64), layout, micro_batch=2, seq=64, blocks=4,
                                          element_size=4)                  # chapter 06b's formula, the same


def test_cp_memory_ring_keeps_no_scores_ulysses_keeps_a_over_cp_of_them():
    long = Transformer(layers=2, hidden=64, heads=8, vocab=128, seq_len=1024)
    one = estimate(long, CLUSTER, Layout(micro_batch=1), **FP32)
    ring = estimate(long, CLUSTER, Layout(cp=4, micro_batch=1), **FP32)
    uly = estimate(long, CLUSTER, Layout(cp=4, cp_method="ulysses", micro_batch=1), **FP32)
    scores_one = one.memory["activations"] - estimate(long, CLUSTER, Layout(micro_batch=1, recompute="selective"),
                                                      **FP32).memory["activations"]
    # Ulysses: every token of a/cp heads: the one-device scores ÷ cp; ring: none kept (one block in buffers)
    no_scores = estimate(long, CLUSTER, Layout(cp=4, micro_batch=1, recompute="selective"), **FP32)
    assert uly.memory["activations"] - no_scores.memory["activations"] == pytest.approx(scores_one / 4)
    assert ring.memory["activations"] == no_scores.memory["activations"] and uly.memory["buffers"] == 0
    assert ring.memory["activations"] < uly.memory["activations"] < one.memory["activations"]


@pytest.mark.parametrize("layout, match", [
    (Layout(cp=16, cp_method="ulysses"), "whole heads"), (Layout(cp=2, cp_method="spiral"), "unknown context"),
    (Layout(cp=64, cp_method="ring-zigzag"), "2·cp chunks")])
def test_cp_validate_names_the_problem(layout, match):
    with pytest.raises(ValueError, match=match):
        validate(DENSE, layout, CLUSTER)


def test_moe_parameters_and_flops():
    h, f, E = 64, 256, 8
    mlp = h * f + f + f * h + h
    assert layer_parameters(MOE) == layer_parameters(DENSE) + (E - 1) * mlp + h * E      # E MLPs and a router
    assert parameters(MOE) == parameters(DENSE) + 4 * ((E - 1) * mlp + h * E)
    assert expert_parameters(MOE, 1, 4) == 2 * mlp and expert_parameters(DENSE) == 0
    assert layer_parameters(MOE, 1, 4) == layer_parameters(DENSE) - mlp + 2 * mlp + h * E
    # a stage's expert parameters: its layers × E/ep whole experts (pp 2: 2 layers; expert-TP = 1)
    assert stage_parameters(MOE, Layout(pp=2, ep=4))["experts"] == 2 * 2 * mlp
    assert stage_parameters(MOE, Layout(tp=2, ep=8))["experts"] == 4 * 1 * mlp      # whole experts: tp splits none
    assert stage_parameters(DENSE, Layout(pp=2))["experts"] == 0
    tokens = 100
    dense_mlp_flops = 2 * tokens * 2 * h * f
    assert forward_flops(MOE, tokens) == pytest.approx(
        forward_flops(DENSE, tokens) + 4 * (dense_mlp_flops * (2 * 1.25 - 1) + 2 * tokens * h * E))


def test_ep_all_to_all_bytes_and_expert_data_parallel_gradients():
    layout = Layout(dp=8, ep=4, micro_batch=2, micro_batches=3)
    e = estimate(MOE, CLUSTER, layout, **FP32)
    one = predicted_all_to_all_bytes(2 * 64, 64, MOE, 4, element_size=4)   # per direction, per MoE layer
    assert e.bytes_sent["ep"] == pytest.approx(2 * one["wire"] * 4 * 3)
    assert one["formula"] == 2 * 2 * 1.25 * 128 * 64 * 4                   # 2·k·cf·T·h·b
    psi, experts = stage_parameters(MOE, layout)["first"], stage_parameters(MOE, layout)["experts"]
    assert experts == 4 * 2 * (64 * 256 + 256 + 256 * 64 + 64)            # 4 layers × 8/ep experts, each an MLP
    dense = zero_memory.bytes_sent_per_step(psi - experts, 8, 0, "fp32")
    assert e.bytes_sent["dp"] == pytest.approx(dense + zero_memory.bytes_sent_per_step(experts, 2, 0, "fp32"))
    # model states: dense ones sharded (ZeRO-1) over dp·cp = 8, experts over expert-DP = 8/4 = 2
    z1 = estimate(MOE, CLUSTER, layout.replace(zero=1), **FP32)
    want = (zero_memory.model_state_bytes_formula(psi - experts, 8, 1, "fp32")["optimizer"]
            + zero_memory.model_state_bytes_formula(experts, 2, 1, "fp32")["optimizer"])
    assert z1.memory["optimizer"] == pytest.approx(want)
    # more ep: fewer experts per rank, less memory, more of the all-to-all leaves the rank
    two = estimate(MOE, CLUSTER, layout.replace(ep=2), **FP32)
    assert two.memory["params"] > e.memory["params"] and two.bytes_sent["ep"] < e.bytes_sent["ep"]


@pytest.mark.parametrize("model, layout, match", [
    (DENSE, Layout(dp=2, ep=2), "mixture-of-experts"), (MOE, Layout(dp=3, ep=3), "divide the 8 experts"),
    (MOE, Layout(dp=2, ep=4), "must divide dp·cp")])
def test_ep_validate_names_the_problem(model, layout, match):
    with pytest.raises(ValueError, match=match):
        validate(model, layout, CLUSTER)


def test_planner_searches_cp_methods_and_ep():
    found = {(x.cp, x.cp_method, x.ep) for x in layouts(MOE, a100_cluster(1), 8, cp=(1, 2), ep=(1, 2, 4),
                                                         cp_methods=("ring", "ulysses"), recompute=("none",))}
    assert {(2, "ulysses", 2), (1, "ring", 4), (2, "ring", 1)} <= found
    assert all(x.ep == 1 for x in layouts(DENSE, a100_cluster(1), 8, ep=(1, 2), recompute=("none",)))
    best = plan(MOE, a100_cluster(1), 8, ep=(1, 2, 4, 8), recompute=("none",), overlap=True)
    assert any("EP" in family for family in best.families)


def test_folded_ep_keeps_the_dp_ring_inside_one_node():
    """ep is folded into dp × cp (it adds no ranks): Layout(dp=8, ep=8) is 8 ranks, one DGX node, so every
    group — dp, ep — runs over NVLink. The planner once counted ep among the ranks (dp ring 8 × 8 > 8 devices
    per node) and priced the dp ring on InfiniBand: the estimate then changed with the inter-node link."""
    import dataclasses
    node = a100_cluster(1)
    slow_between_nodes = dataclasses.replace(node, inter_bw=1.0, inter_latency=1.0)   # 1 B/s, 1 s: unmissable
    layout = Layout(dp=8, ep=8, micro_batch=2, micro_batches=2)
    assert dim_link(layout, "dp", node) == dim_link(layout, "ep", node) == (node.intra_bw, node.intra_latency)
    assert estimate(MOE, slow_between_nodes, layout, **FP32).time == estimate(MOE, node, layout, **FP32).time
    across = Layout(dp=16, ep=8, micro_batch=2, micro_batches=2)       # 16 ranks: the dp ring spans 2 nodes
    rails = min(CLUSTER.intra_bw, 8 * CLUSTER.inter_bw)     # 8 of its ranks a node: it crosses on 8 NICs at once
    assert dim_link(across, "dp", CLUSTER) == (rails, CLUSTER.inter_latency)
    assert dim_link(across, "ep", CLUSTER) == (CLUSTER.intra_bw, CLUSTER.intra_latency)   # 8 consecutive ranks

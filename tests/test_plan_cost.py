"""minipar.plan.cost: each term of the estimate against the formula it stands for."""
import pytest

from minipar.comm import predicted_bytes_sent
from minipar.data import zero_memory
from minipar.pipeline.schedules import bubble_formula
from minipar.machine.cluster import link, this_machine
from minipar.machine.device import A100_SXM_80GB
from minipar.plan import (GPT3_175B, Cluster, Layout, Transformer, a100_cluster, activation_bytes_per_layer,
                          collective_seconds, estimate, hardware_flops, in_flight, stage_parameters, validate)
from minipar.plan.operators import stage_seconds
from minipar.tensor.sequence import sp_bytes_per_layer, tp_bytes_per_layer

CLUSTER = a100_cluster(128)
SMALL = Transformer(layers=8, hidden=64, heads=4, vocab=128, seq_len=32)


@pytest.mark.parametrize("schedule, p, m, v, want", [("gpipe", 4, 8, 1, 8), ("1f1b", 4, 8, 1, 4),
                                                     ("1f1b", 8, 32, 1, 8), ("interleaved", 4, 8, 2, 4 + 3 / 2),
                                                     ("interleaved", 4, 16, 4, 4 + 3 / 4)])
def test_in_flight_counted_on_the_schedule(schedule, p, m, v, want):
    # GPipe m; 1F1B p; interleaved p + (p-1)/v (Korthikanti et al. 2022 §4.2.3: L(1 + (p-1)/(pv)) on rank 0)
    assert in_flight(schedule, p, m, v) == pytest.approx(want)


@pytest.mark.parametrize("schedule, want", [("1f1b", 1), ("gpipe", 8), ("zb-h1", 4)])
def test_the_last_rank_holds_what_its_schedule_says(schedule, want):
    """The last stage is not always the lightest: 1F1B runs each micro-batch's backward at once (1 in flight),
    GPipe holds all m, ZB-H1's deferred W holds p. The cost model keeps each of them — the output layer's
    logits included — and the tour's ZB-H1 and GPipe rows found the miss when it assumed 1 (chapter 12)."""
    assert in_flight(schedule, 4, 8, rank=3) == want
    layout = Layout(pp=4, schedule=schedule, micro_batch=2, micro_batches=8)
    e = estimate(SMALL, CLUSTER, layout, precision="fp32", dropout=False)
    one = estimate(SMALL, CLUSTER, Layout(pp=4, schedule="1f1b", micro_batch=2, micro_batches=8), precision="fp32",
                   dropout=False)
    if schedule != "1f1b":           # the busiest device is now the last one, with `want` micro-batches' logits
        assert e.memory["activations"] > one.memory["activations"]


def test_memory_terms_are_the_formulas():
    layout = Layout(dp=8, tp=8, pp=16, sp=True, recompute="selective", micro_batches=192)
    e = estimate(GPT3_175B, CLUSTER, layout)
    params = stage_parameters(GPT3_175B, layout)["first"]
    states = zero_memory.model_state_bytes_formula(params, 8, 0, "mixed")
    assert e.memory["params"] == states["params"] and e.memory["optimizer"] == states["optimizer"]
    per_layer = activation_bytes_per_layer(GPT3_175B, 1, 8, True, "selective")
    assert e.memory["activations"] == pytest.approx(per_layer * 96 / 16 * 16)     # 1F1B: p in flight on rank 0
    assert e.memory["total"] == pytest.approx(sum(v for k, v in e.memory.items() if k != "total"))
    assert e.fits


def test_zero_shards_model_states_and_adds_its_buffers():
    base = estimate(SMALL, CLUSTER, Layout(dp=8))
    for stage in (1, 2, 3):
        e = estimate(SMALL, CLUSTER, Layout(dp=8, zero=stage))
        want = zero_memory.model_state_bytes_formula(stage_parameters(SMALL, Layout())["first"], 8, stage)
        assert e.memory["optimizer"] == want["optimizer"] and e.memory["grads"] == want["grads"]
        assert e.memory["activations"] == base.memory["activations"]
        layer = stage_parameters(SMALL, Layout())["layer"]
        ring = 2 * layer * (1 + 2 / 8) if stage >= 2 else 0          # one layer's 16-bit gradients in a ring
        gathered = 2 * (2 * layer + SMALL.vocab * 64 + SMALL.positions * 64) if stage == 3 else 0
        assert e.memory["buffers"] == pytest.approx(ring + gathered)


def test_bytes_sent_are_the_chapters_formulas():
    b, m = 2, 4
    e = estimate(SMALL, CLUSTER, Layout(dp=2, tp=4, pp=2, micro_batch=b, micro_batches=m), precision="fp32")
    layers = SMALL.layers // 2
    assert e.bytes_sent["tp"] == pytest.approx(tp_bytes_per_layer(32, b, 64, 4, 4) * layers * m)
    assert e.bytes_sent["pp"] == pytest.approx(2 * (2 - 1) * m * 32 * b * 64 * 4 / 2)
    psi = stage_parameters(SMALL, Layout(dp=2, tp=4, pp=2))["first"]
    assert e.bytes_sent["dp"] == pytest.approx(zero_memory.bytes_sent_per_step(psi, 2, 0, "fp32"))
    sp = estimate(SMALL, CLUSTER, Layout(dp=2, tp=4, pp=2, sp=True, micro_batch=b, micro_batches=m), precision="fp32")
    assert sp.bytes_sent["tp"] == pytest.approx(sp_bytes_per_layer(32, b, 64, 4, 4) * layers * m)


def test_zero_2_and_3_repeat_their_collectives_per_micro_batch():
    one = estimate(SMALL, CLUSTER, Layout(dp=8, zero=3))
    psi = stage_parameters(SMALL, Layout())["first"]
    assert one.bytes_sent["dp"] == pytest.approx(zero_memory.bytes_sent_per_step(psi, 8, 3))
    four = estimate(SMALL, CLUSTER, Layout(dp=8, zero=3, micro_batches=4))
    assert four.bytes_sent["dp"] == pytest.approx(4 * one.bytes_sent["dp"])
    z1 = estimate(SMALL, CLUSTER, Layout(dp=8, zero=1, micro_batches=4))
    assert z1.bytes_sent["dp"] == pytest.approx(zero_memory.bytes_sent_per_step(psi, 8, 1))


def test_time_terms():
    layout = Layout(dp=8, tp=8, pp=16, micro_batches=192)
    e = estimate(GPT3_175B, CLUSTER, layout)
    compute = 192 * stage_seconds(GPT3_175B, layout, A100_SXM_80GB)["slowest"]     # m × the slowest stage's ops
    assert e.time["compute"] == pytest.approx(compute, rel=1e-12)
    f = bubble_formula("1f1b", 16, 192)          # an idle slot lasts a stage's work: compute and tp collectives
    assert e.time["bubble"] == pytest.approx((compute + e.time["tp"]) * f / (1 - f))
    assert e.time["tp"] > 0
    assert e.time["total"] == pytest.approx(sum(v for k, v in e.time.items() if k != "total"))
    inter = estimate(GPT3_175B, CLUSTER, Layout(dp=8, tp=8, pp=16, v=2, schedule="interleaved", micro_batches=192))
    assert inter.time["bubble"] < e.time["bubble"] and inter.bytes_sent["pp"] > e.bytes_sent["pp"]
    assert 0 < e.mfu < 1


def test_compute_without_a_card_is_flops_over_the_measured_rate():
    """A CPU cluster (this_machine: a rank's FLOP/s measured here) has no card: hardware FLOPs / (n · F)."""
    cpu = this_machine(alpha=1e-4, beta=1e9, flops_per_second=2e10, devices=8)
    e = estimate(SMALL, cpu, Layout(dp=8, micro_batch=2))
    assert e.time["compute"] == pytest.approx(hardware_flops(SMALL, 16) / (8 * 2e10), rel=1e-12)


def test_tp_across_nodes_uses_the_slow_link():
    inside = estimate(GPT3_175B, CLUSTER, Layout(dp=8, tp=8, pp=16, micro_batches=192))
    across = estimate(GPT3_175B, CLUSTER, Layout(dp=4, tp=16, pp=16, micro_batches=384))
    # a TP group of 16 spans two nodes, 8 GPUs on each: its ring crosses on 8 InfiniBand rails at once,
    # min(NVLink β, 8 × HDR β) = min(231, 180) GB/s, and every step pays the inter-node latency
    assert link(CLUSTER, range(16)) == (pytest.approx(8 * 25e9 * 0.9), 10e-6)
    assert link(CLUSTER, range(8)) == (pytest.approx(300e9 * 0.77), 5e-6)
    assert across.time["tp"] > inside.time["tp"]


def test_collective_seconds_alpha_beta():
    assert collective_seconds("all_reduce", 1e6, 4, 1e9, 1e-5) == pytest.approx(6e-5 + predicted_bytes_sent(
        "all_reduce", 1e6, 4) / 1e9)
    assert collective_seconds("send", 1e6, 2, 1e9, 1e-5) == pytest.approx(1e-5 + 1e-3)
    assert collective_seconds("all_gather", 1e6, 1, 1e9, 1e-5) == 0


@pytest.mark.parametrize("layout, match", [
    (Layout(tp=5), "tp=5 must divide"), (Layout(pp=5, micro_batches=5), "cannot be cut"),
    (Layout(tp=2, sp=False, dp=2, ep=2), "mixture-of-experts"), (Layout(dp=1, ep=2), "must divide dp·cp"), (Layout(sp=True), "needs tp > 1"),
    (Layout(pp=2, micro_batches=1), "m >= p"), (Layout(zero=4), "zero must be"),
    (Layout(recompute="half"), "recompute must be"), (Layout(dp=2048), "cluster has 1024"),
    (Layout(v=2), "needs a pipeline")])
def test_validate_names_the_problem(layout, match):
    with pytest.raises(ValueError, match=match):
        validate(GPT3_175B, layout, CLUSTER)


def test_cluster_devices():
    assert CLUSTER.devices == 1024 and Cluster(4, 2, 1e9, 1e12, 1e9, 1e8).devices == 8


def test_context_parallel_is_ring_attention_over_dp_cp_data_ranks():
    """CP as chapter 06b teaches it: ring attention's bytes per layer and micro-batch (K, V forward cp-1 times;
    K, V and dK, dV 2cp-1 times backward); CP ranks hold the same parameters, so the gradients are averaged —
    and ZeRO shards — over dp·cp ranks: dp=2 × cp=4 sends and keeps what dp=8 does."""
    from minipar.sequence import ring_attention
    b, m, cp = 2, 4, 4
    e = estimate(SMALL, CLUSTER, Layout(dp=2, cp=cp, micro_batch=b, micro_batches=m), precision="fp32")
    per_layer = (ring_attention.forward_bytes(b, SMALL.seq_len, SMALL.hidden, cp, 4)
                 + ring_attention.backward_bytes(b, SMALL.seq_len, SMALL.hidden, cp, 4))
    assert per_layer == (4 * cp - 2 + 2 * (cp - 1)) * b * SMALL.seq_len // cp * SMALL.hidden * 4
    assert e.bytes_sent["cp"] == per_layer * SMALL.layers * m
    for zero in (0, 1, 3):
        dp_cp = estimate(SMALL, CLUSTER, Layout(dp=2, cp=cp, zero=zero))
        dp_only = estimate(SMALL, CLUSTER, Layout(dp=8, zero=zero))
        assert dp_cp.bytes_sent["dp"] == dp_only.bytes_sent["dp"] > 0
        for term in ("params", "grads", "optimizer"):
            assert dp_cp.memory[term] == dp_only.memory[term]
    # no s² score matrix is kept: activations = the selective count on s/cp tokens, plus one (s/cp)² block
    long = Transformer(layers=2, hidden=64, heads=4, vocab=128, seq_len=1024)
    ring = estimate(long, CLUSTER, Layout(cp=4, micro_batch=1), precision="fp32", dropout=False)
    keep = activation_bytes_per_layer(long, 1, 1, False, "selective", value_bytes=4, dropout=False, seq_len=256)
    assert ring.memory["buffers"] == 2 * 4 * 256 * 256 * long.heads
    assert ring.memory["activations"] == pytest.approx(keep * 2 + 4 * 256 * 128 + 2 * 4 * 256 * 64)


def test_planner_proposes_context_parallelism_when_asked():
    from minipar.plan import layouts
    found = {x.cp for x in layouts(SMALL, a100_cluster(1), 8, cp=(1, 2, 4), recompute=("none",))}
    assert found == {1, 2, 4}
    assert {x.cp for x in layouts(SMALL, a100_cluster(1), 8, recompute=("none",))} == {1}


LLAMA3_SHAPE = Transformer(layers=126, hidden=1024, heads=16, vocab=4096, seq_len=1024, ffn_hidden=3328,
                           tied_embeddings=False, final_norm=True, kv_heads=2, gated_mlp=True)


def test_llama3s_balanced_cut_prices_the_fullest_stage():
    """126 layers on 16 stages (Llama 3 405B, Dubey et al. 2024 §3.3.2): 7, 8 × 14, 7 — the embedding and the
    output each in a layer's place; the slowest stage is a middle one. The old planner refused the layout."""
    from minipar.plan.model import stage_layers
    assert stage_layers(126, 16, 8) == (7, 8, 7) and stage_layers(96, 8, 2) == (12, 12, 12)
    with pytest.raises(ValueError, match="cannot be cut"):
        stage_layers(125, 16, 1)
    layout = Layout(tp=8, pp=16, v=8, sp=True, micro_batches=32, schedule="interleaved")
    stage = stage_seconds(LLAMA3_SHAPE, layout, A100_SXM_80GB)
    assert stage["slowest"] == pytest.approx(8 * stage["layer"]) and stage["last"] < stage["slowest"]
    assert stage_parameters(LLAMA3_SHAPE, layout)["first"] < 8 * stage_parameters(LLAMA3_SHAPE, layout)["layer"]
    assert estimate(LLAMA3_SHAPE, a100_cluster(16), layout).time["compute"] == pytest.approx(32 * stage["slowest"])


def test_a_context_parallel_rank_scores_only_its_own_tokens_and_passes_narrow_kv():
    """With cp ranks each computes the logits and the loss of its s/cp tokens (not the whole sequence's), and a
    ring passes K and V, which grouped-query attention makes kv/a of h wide. Both failed on the old planner."""
    from minipar.plan.operators import head_step
    from minipar.machine.device import Op, ops_seconds
    layout = Layout(tp=8, cp=4, sp=True, cp_method="ring-zigzag")
    stage = stage_seconds(LLAMA3_SHAPE, layout, A100_SXM_80GB)
    local = [Op("embedding", "memory", 0.0, 3.0 * 2 * 256 * 1024, 3), *head_step(LLAMA3_SHAPE, 1, 8, seq_len=256)]
    assert stage["last"] == pytest.approx(126 * stage["layer"] + ops_seconds(local, A100_SXM_80GB), rel=1e-12)
    mha = Transformer(layers=126, hidden=1024, heads=16, vocab=4096, seq_len=1024)
    gqa = Transformer(layers=126, hidden=1024, heads=16, vocab=4096, seq_len=1024, kv_heads=2)
    for method, share in (("ring", 2 / 16), ("ulysses", 1.0)):       # Ulysses moves Q and O too: left whole
        got = [estimate(m, a100_cluster(4), Layout(tp=4, cp=4, sp=True, cp_method=method)).bytes_sent["cp"]
               for m in (gqa, mha)]
        assert got[0] == pytest.approx(share * got[1])

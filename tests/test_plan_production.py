"""What production runs do, in the planner: a fused (flash) attention kernel keeps no s² scores, grouped-query
attention and a gated MLP change the activations kept, and overlap="production" hides TP (async TP), PP's
p2p and CP's ring under compute, each hidden term reported beside the exposed one. Numbers by hand."""
import pytest

from minipar.layout import Layout
from minipar.machine.cluster import a100_cluster
from minipar.plan import estimate
from minipar.plan.model import Transformer, activation_bytes_per_layer
from minipar.plan.operators import MEGATRON_2022, TORCHTITAN_EAGER, stage_seconds
from minipar.plan.overlap import TP_CHUNKS, model_parallel_exposed

LONG = Transformer(8, 4096, 32, 32000, 16384)            # long sequences: the s² scores dwarf the rest


def test_a_flash_kernel_keeps_no_scores():
    layout = Layout(tp=8, sp=True, micro_batch=1)
    fused = estimate(LONG, a100_cluster(1), layout, kernels=TORCHTITAN_EAGER).memory["activations"]
    scores = estimate(LONG, a100_cluster(1), layout, kernels=MEGATRON_2022).memory["activations"]
    kept = activation_bytes_per_layer(LONG, 1, 8, True, "selective")       # sbh·34/t: what recomputing keeps
    s, h, a = LONG.seq_len, LONG.hidden, LONG.heads
    assert scores - fused == pytest.approx(LONG.layers * 5 * a * s * s / 8, rel=1e-9)   # 5as²b/t per layer
    assert fused == pytest.approx(LONG.layers * kept + 4 * s * 32000 / 8 + 2 * 2 * s * h / 8, rel=1e-9)


def test_gqa_and_a_gated_mlp_change_what_a_layer_keeps():
    s, b, h, a, f = 2048, 1, 4096, 32, 14336
    plain = Transformer(1, h, a, 1000, s, ffn_hidden=f)
    gqa = Transformer(1, h, a, 1000, s, ffn_hidden=f, kv_heads=8)
    gated = Transformer(1, h, a, 1000, s, ffn_hidden=f, gated_mlp=True)
    base = activation_bytes_per_layer(plain, b, 2)
    assert base - activation_bytes_per_layer(gqa, b, 2) == pytest.approx(2 * 2 * s * b * h * (1 - 8 / 32) / 2)
    assert activation_bytes_per_layer(gated, b, 2) - base == pytest.approx(2 * s * b * f / 2)
    assert activation_bytes_per_layer(gqa, b, 2, recompute="full") == 2 * s * b * h       # the input alone


def test_production_overlap_forms():
    seconds = {"tp": 2.0, "pp": 0.8, "cp": 1.0}
    got = model_parallel_exposed("production", seconds, gemm=2.0, attention=1.2, compute=4.0, m=4, cp=4)
    assert got["tp"] == pytest.approx(max(2.0 / TP_CHUNKS, 2.0 - 2.0 * 3 / 4))        # 0.5
    assert got["pp"] == pytest.approx(0.2)                 # the first send; the rest under 1 s of compute each
    assert got["cp"] == pytest.approx(1.0 - 1.2 * 3 / 4)
    assert model_parallel_exposed(True, seconds, 2.0, 1.2, 4.0, 4, 4) == {}          # DDP/DeepSpeed: none


def test_the_estimate_reports_hidden_beside_exposed():
    model = Transformer(16, 8192, 64, 32000, 4096)
    layout = Layout(tp=8, pp=2, dp=2, sp=True, recompute="selective", micro_batch=1, micro_batches=8)
    cluster = a100_cluster(4)
    plain = estimate(model, cluster, layout, overlap=True)
    prod = estimate(model, cluster, layout, overlap="production")
    for term in ("tp", "pp"):
        assert prod.time[term] + prod.hidden[term] == pytest.approx(plain.time[term] + plain.hidden.get(term, 0))
        assert 0 < prod.time[term] < plain.time[term]
    gemm = 8 * stage_seconds(model, layout, cluster.device)["gemm"]
    assert prod.time["tp"] == pytest.approx(max(plain.time["tp"] / 4, plain.time["tp"] - gemm * 3 / 4))
    assert "hidden)" in str(prod) and prod.step_seconds < plain.step_seconds

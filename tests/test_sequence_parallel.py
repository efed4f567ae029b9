"""Megatron sequence parallelism (minipar.tensor with sequence_parallel=True) against one device.

Tolerances as in test_tensor_parallel: float64 + Adam at the harness's float64 tolerance (atol 1e-10,
rtol 1e-9). Bytes are compared exactly with the formula; activation bytes exactly with the Korthikanti
et al. (2022) count scaled to float32 plus the two things it leaves out (LayerNorm statistics, the causal
mask).
"""
import pytest
import torch

from minipar.check import gpt_recipe
from minipar import launch
from minipar.tensor import gpt as tp_gpt
from minipar.models import GPTConfig
from minipar.tensor.gpt import compare_to_one_device
from minipar.tensor.measure import measure_layer
from minipar.activations import activation_bytes_formula
from minipar.tensor.sequence import (korthikanti_bytes, sp_bytes_per_layer,
                                     tp_bytes_per_layer, uncounted_bytes)

QUIET = {"quiet": True}


def _recipe(**cfg):
    # 2 steps: Adam's state is used from step 2
    recipe = gpt_recipe(steps=2, batch_size=4, seq_len=16, vocab_size=66, **cfg)
    recipe.dtype = torch.float64
    return recipe


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_sp_gpt_trains_like_one_device(tp):
    """Loss at each of 2 Adam steps and every parameter equal one device, label smoothing 0.1."""
    compare_to_one_device(_recipe(), world_size=tp, sequence_parallel=True, label_smoothing=0.1, launch_kwargs=QUIET).assert_ok()


def test_tp_sp_without_label_smoothing_and_tied_weights():
    compare_to_one_device(_recipe(tie_weights=True), world_size=4, sequence_parallel=True, launch_kwargs=QUIET).assert_ok()


def test_without_the_layernorm_gradient_sum_it_does_not_match(monkeypatch):
    """LayerNorm weights, row-parallel biases and the position embedding see only a sequence shard:
    skipping their gradient all-reduce must break equivalence (the test can fail)."""
    monkeypatch.setattr(tp_gpt.TensorParallelGPT, "finish_backward", lambda self: None)
    comparison = compare_to_one_device(_recipe(), world_size=2, sequence_parallel=True, launch_kwargs=QUIET)
    assert not comparison.matches
    assert any("ln" in p or "pos_emb" in p or "proj.bias" in p for p in comparison.problems)


def test_sequence_length_not_divisible_raises_before_any_process(monkeypatch):
    monkeypatch.setattr(tp_gpt, "check_equivalence", lambda *a, **k: pytest.fail("launched anyway"))
    recipe = gpt_recipe(steps=1, seq_len=15)
    with pytest.raises(ValueError, match="sequence length 15 is not divisible by 4"):
        compare_to_one_device(recipe, world_size=4, sequence_parallel=True)


def layer_costs(rank, world_size, sequence_parallel, b=2, s=16, h=32, a=4):
    """One transformer block's bytes and saved activations on this rank, without and with dropout."""
    return {p: measure_layer(rank, world_size, GPTConfig(n_embd=h, n_head=a, dropout=p), b, s, sequence_parallel)
            for p in (0.0, 0.1)}


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_bytes_and_activation_memory_per_layer(tp):
    """Bytes per layer per step: 4 reduce-scatters and 4 all-gathers (each RS+AG = one all-reduce's bytes),
    plus the 2 all-gathers of the column-parallel inputs again in backward (the memory saving's price).
    Activations: measured = sbh(34/t + 5as/(ht)) scaled to float32 values and 1-byte masks + LayerNorm
    statistics + causal mask, exactly, with and without dropout; and less than TP alone."""
    b, s, h, a = 2, 16, 32, 4
    sbh_bytes = b * s * h * 4
    for by_dropout in launch(layer_costs, tp, True, **QUIET):
        for p, res in by_dropout.items():
            calls = {op: n for op, (n, _) in res["by_op"].items()}
            assert calls == {"all_gather": 6, "reduce_scatter": 4}
            ag, rs = res["by_op"]["all_gather"][1], res["by_op"]["reduce_scatter"][1]
            assert 3 * rs + 2 * ag == 3 * tp_bytes_per_layer(s, b, h, tp)     # 4 RS + 4 AG = 4 all-reduces
            assert res["bytes_sent"] == sp_bytes_per_layer(s, b, h, tp) == \
                tp_bytes_per_layer(s, b, h, tp) + 2 * (tp - 1) / tp * sbh_bytes
            formula = activation_bytes_formula(s, b, h, a, t=tp, sequence_parallel=True, value_bytes=4, dropout=p > 0)
            assert res["activation_bytes"] == formula + uncounted_bytes(s, b, tp, sequence_parallel=True)
            assert res["activation_bytes"] < activation_bytes_formula(s, b, h, a, t=tp, value_bytes=4, dropout=p > 0)


def test_generalised_count_reduces_to_the_papers_formulas():
    """At 2-byte values, 1-byte masks and dropout on, the element count gives eq. 2-4 of the paper."""
    for s, b, h, a in [(2048, 4, 12288, 96), (16, 2, 32, 4)]:
        for t in (1, 2, 8):
            for sp in (False, True):
                assert activation_bytes_formula(s, b, h, a, t=t, sequence_parallel=sp) == \
                    pytest.approx(korthikanti_bytes(s, b, h, a, t, sp))
        assert activation_bytes_formula(s, b, h, a) == pytest.approx(s * b * h * (34 + 5 * a * s / h))


def _keep_gathered_layer(rank, world_size, keep, rings=False, sp=True):
    from minipar.course.tp_layer import measure_layer_on_wire
    return measure_layer_on_wire(rank, world_size, GPTConfig(n_embd=32, n_head=4), sp, keep, b=2, s=16, rings=rings)


def _every_kept_variant(rank, world_size, recipe):
    """The four layer measurements and the kept-inputs training one after another on this rank: one launch
    for all (each measurement records its own log and socket bytes)."""
    from minipar.course.ch05_tensor_parallelism.tour import _train_kept
    return {"kept": _keep_gathered_layer(rank, world_size, True),
            "regathered": _keep_gathered_layer(rank, world_size, False),
            "on rings": _keep_gathered_layer(rank, world_size, True, True),
            "plain tp": _keep_gathered_layer(rank, world_size, False, False, False),
            "trained": _train_kept(rank, world_size, recipe)}


def test_keeping_the_gathered_inputs_sends_tps_bytes_and_keeps_more():
    """SP with the column-parallel inputs kept for backward (layers.keep_gathered_inputs): the log's bytes
    equal TP's exactly (no re-gather); the bytes on the wire fall by the two re-gathers (+ at most 2 calls of
    gloo headers); the activations kept grow by the gathered inputs; training still equals one device."""
    tp, b, s, h = 4, 2, 16, 32
    recipe = gpt_recipe(steps=2, batch_size=4, seq_len=16, vocab_size=66, n_embd=32, n_head=4)
    recipe.dtype = torch.float64
    per_rank = launch(_every_kept_variant, tp, recipe, **QUIET)
    kept, regathered, on_rings, plain_tp, trained = ([r[k] for r in per_rank] for k in
                                                     ("kept", "regathered", "on rings", "plain tp", "trained"))
    regather = 2 * (tp - 1) / tp * b * s * h * 4
    for k, r in zip(kept, regathered):
        assert k[0] == tp_bytes_per_layer(s, b, h, tp) == sp_bytes_per_layer(s, b, h, tp, regather=False)
        assert r[0] == k[0] + regather
        assert k[3] > r[3]
    if kept[0][1] is not None:
        wire_saved = sum(r[1] for r in regathered) / tp - sum(k[1] for k in kept) / tp
        assert regather <= wire_saved <= regather + 2 * 2048, wire_saved
        # with the reduce-scatters on minipar's ring (gloo's all-reduce: 2x), the wire shows TP's bytes too
        ring_wire, tp_wire = (sum(r[1] for r in runs) / tp for runs in (on_rings, plain_tp))
        assert on_rings[0][0] == plain_tp[0][0] <= ring_wire <= tp_wire, (ring_wire, tp_wire)
    from minipar.check import compare, train_reference
    from minipar.tensor.gpt import smoothed_recipe
    compare(train_reference(smoothed_recipe(recipe, 0.1)), trained,
            dtype=recipe.dtype).assert_ok()

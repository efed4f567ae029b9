"""Recomputation changes memory and compute, never the numbers.

* Gradients with full, selective or per-block mixed recomputation are bit-identical to none, dropout
  included (the checkpoint replays the RNG state); a few Adam steps give bit-identical parameters
  (``compare`` with atol = rtol = 0).
* Bytes one block keeps for backward, measured with minipar.memory's LiveTensorTracker, against
  Korthikanti et al.'s counts scaled to the dtype (β = 4 for FP32, 2 for BF16; on CPU the dropout mask is
  a β-byte tensor, not CUDA's 1-byte one): full is exact (β·sbh); none and selective within 1% — the rest is
  LayerNorm's mean/rstd (4 values per token) and the causal mask (s² bytes), which the formula leaves out.
* Extra FLOPs (FlopCounterMode): full adds exactly one forward of every block; selective adds exactly
  one QKᵀ per block (2·b·s²·h): the non-reentrant checkpoint stops recomputing once it has rebuilt every
  saved tensor, so softmax(·)V is not rerun.
"""
import pytest
import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.models import GPTConfig, TinyGPT
from minipar.activations import activation_bytes_formula
from minipar.recompute import (MODES, activation_bytes_per_block, apply_recompute,
                               recompute_modes, remove_recompute, step_flops)

CFG = GPTConfig(n_layer=3, n_embd=64, n_head=4, block_size=64, dropout=0.1)
S, B = 64, 4                                     # memory: long enough for the s² terms to show
S_SHORT = 16                                     # gradients and FLOPs: the counts are exact at any length


def _grads(mode, x, y):
    model = apply_recompute(TinyGPT(CFG, seed=0), mode)
    torch.manual_seed(1234)                      # the dropout masks
    loss = model.loss(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_gradients_are_bit_identical_with_dropout(one_thread):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(64, (B, S_SHORT), generator=g), torch.randint(64, (B, S_SHORT), generator=g)
    ref_loss, ref = _grads("none", x, y)
    for mode in ("selective", "full", ["full", "none", "selective"]):
        loss, got = _grads(mode, x, y)
        assert torch.equal(loss, ref_loss)
        for n in ref:
            assert torch.equal(got[n], ref[n]), (mode, n)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_training_steps_bit_identical(one_thread, mode):
    recipe = gpt_recipe(steps=3)
    ref = train_reference(recipe)
    make = recipe.model
    recipe.model = lambda: apply_recompute(make(), mode)
    compare(ref, [train_reference(recipe)], atol=0, rtol=0).assert_ok()


@pytest.mark.parametrize("dtype,beta", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_activation_bytes_per_block_match_formula(dtype, beta):
    measured = {m: activation_bytes_per_block(CFG, m, B, S, dtype) for m in MODES}
    for mode in MODES:
        want = activation_bytes_formula(S, B, CFG.n_embd, CFG.n_head, recompute=mode, value_bytes=beta,
                                        mask_bytes=beta)
        if mode == "full":
            assert measured[mode] == want
        else:
            assert abs(measured[mode] - want) <= 0.01 * want, (mode, measured[mode], want)
    assert measured["none"] > measured["selective"] > 15 * measured["full"]


def test_formula_is_the_papers_in_16_bit():
    s, b, h, a = 2048, 1, 12288, 96                        # GPT-3 175B's layer, one sequence
    assert activation_bytes_formula(s, b, h, a, recompute="none") == s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes_formula(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert activation_bytes_formula(s, b, h, a, recompute="full") == 2 * s * b * h


def test_extra_flops_counted():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(64, (B, S_SHORT), generator=g), torch.randint(64, (B, S_SHORT), generator=g)
    flops = {m: step_flops(apply_recompute(TinyGPT(CFG), m), x, y) for m in MODES}
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter:
        TinyGPT(CFG).blocks[0](torch.randn(B, S_SHORT, CFG.n_embd))
    block_forward = counter.get_total_flops()
    assert flops["full"] - flops["none"] == CFG.n_layer * block_forward
    assert flops["selective"] - flops["none"] == CFG.n_layer * 2 * B * S_SHORT * S_SHORT * CFG.n_embd


def test_modes_validated_and_removable():
    model = TinyGPT(CFG)
    with pytest.raises(ValueError):
        apply_recompute(model, "half")
    with pytest.raises(ValueError):
        apply_recompute(model, ["full", "none"])           # 3 blocks
    apply_recompute(model, ["full", "selective", "none"])
    assert recompute_modes(model) == ["full", "selective", "none"]
    assert "forward" in model.blocks[0].__dict__ and "attention" in model.blocks[1].attn.__dict__
    remove_recompute(model)
    assert "forward" not in model.blocks[0].__dict__ and "attention" not in model.blocks[1].attn.__dict__
    with pytest.raises(ValueError):
        activation_bytes_formula(1, 1, 1, 1, recompute="most")

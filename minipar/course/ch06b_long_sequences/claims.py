"""Chapter 06b's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import torch

from minipar.sequence import ring_attention as ra
from minipar.sequence import ulysses
from minipar.tensor.sequence import korthikanti_bytes


def check_why_long_sequences_break_tp(a, t, h) -> None:
    """Why long sequences break TP + SP"""
    assert 5 * a * 131072**2 / t > 0.9 * korthikanti_bytes(131072, 1, h, a, t, True)


def check_log_sum_exp_merge_numerically(o, o_full, lse, lse_full) -> None:
    """The log-sum-exp merge, numerically"""
    assert torch.allclose(o, o_full, atol=1e-14) and torch.allclose(lse, lse_full, atol=1e-14)


def check_stable_merge_where_naive_overflows(naive, stable, q, k, v) -> None:
    """The log-sum-exp merge, numerically"""
    assert not torch.isfinite(naive).all() and torch.allclose(stable.double(), ra.block_attention(q * 30, k * 30, v)[0], atol=1e-5)


def check_b_one_device_first_flashattention(n_causal, n_all) -> None:
    """b. One device first: FlashAttention-2"""
    assert n_causal == 6 * 7 // 2 and n_all == 36


def check_flash_attention_matches_blockwise(diffs, L) -> None:
    """b. One device first: FlashAttention-2"""
    assert max(diffs) < 1e-12 and L.shape == (2, 4, 50)


def check_linear_o_d(slope, per_token, rest, de) -> None:
    """b. One device first: FlashAttention-2: linear in s: O(s·d)"""
    assert abs(slope / per_token - 1) < 0.1 and 0 <= rest <= 8 * 64 * 64 * 4    # linear in s: O(s·d)
    assert 3.5 < de[2] / de[1] < 4.5                                           # quadratic in s


def check_ring_step_by_step(counts) -> None:
    """The ring, step by step"""
    assert counts == [1, 2, 3, 4]


def check_ring_steps_match_full_attention(diffs) -> None:
    """The ring, step by step"""
    assert max(diffs) < 1e-12


def check_bytes_per_rank_per_layer(fwd) -> None:
    """Bytes per rank per layer, observed"""
    assert fwd["forward_bytes_sent"] == ra.forward_bytes(4, 16, 32, 4)


def check_bytes_model_equals_formula(r) -> None:
    """Bytes per rank per layer, observed"""
    assert r["model"] == r["formula"]
    assert r["observed"] is None or r["formula"] < r["observed"] < 1.5 * r["formula"]


def check_slowest_rank_what_every_step_waits(balance, by_count, slowest) -> None:
    """Load balance: zig-zag: the slowest rank is what every step waits for"""
    assert balance["ring"][0] == [1, 2, 3, 4] and balance["ring-zigzag"][0] == [9, 9, 9, 9] and by_count == 16 / 9
    assert slowest > 1.2          # the slowest rank is what every step waits for


def check_ulysses_bytes_against_megatron_sp(b, s, h, rows) -> None:
    """DeepSpeed-Ulysses: all-to-all over heads: measured above (§4)"""
    assert ulysses.forward_bytes(b, s, h, 16) * 16 == ulysses.megatron_sp_forward_bytes(b, s, h, 16)
    assert rows["ulysses"]["model"] == 2 * ulysses.forward_bytes(4, 16, 32, 4)   # measured above (§4)


def check_zero_up_rounding_below_atol(grad_k, grad_q, grad_v, k_bias, c) -> None:
    """Ring self-attention (Colossal-AI) and its gradient scaling: zero up to rounding; below atol"""
    assert grad_k < 1e-15 < 1e-6 < min(grad_q, grad_v) and k_bias < c.atol


def check_linear_n_no_anywhere_ring(ring_growth, mem) -> None:
    """Activation memory per rank vs sequence length: linear in s/N: no s² anywhere on the ring"""
    assert abs(ring_growth - 4) < 0.1                         # linear in s/N: no s² anywhere on the ring
    assert mem["ring"][-1] < mem["one device"][-1] / 4 * 1.05  # a quarter of the tokens — and no score matrix


def check_activation_memory_per_rank_vs(three, s2_term) -> None:
    """Activation memory per rank vs sequence length"""
    assert abs((three["dense"] - three["flash"]) / s2_term - 1) < 0.05
    assert 3.5 < three["flash"] / three["ring"] <= 4.05


def check_b_other_giant_logits(diffs, plain, logits, chunked, grads, tokens, chunk) -> None:
    """b. The other giant: the logits"""
    assert max(diffs) < 1e-12
    assert plain[3] >= 2 * logits and chunked[3] < grads + 4 * tokens * chunk * 8 and 10 * chunked[3] < plain[3]


def check_pytorchs_context_parallel(r) -> None:
    """PyTorch's `context_parallel`"""
    assert r[0][3] == "ran" or "sharding strategy" in r[0][3]


def check_torch_context_parallel_matches(r) -> None:
    """PyTorch's `context_parallel`"""
    assert max(x[0] for x in r) < 1e-5

"""Chapter 11's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import torch

from minipar.recompute import MODES


def check_4_4_8_bytes_per_parameter(acc, psi) -> None:
    """Where the memory of one step goes: 4 + 4 + 8 bytes/param"""
    assert acc.params == 4 * psi and acc.grads == 4 * psi and acc.optimizer == 8 * psi   # 4 + 4 + 8 bytes/param
    assert acc.activations > acc.model_states                  # at s = 64 the activations already dominate


def check_head_and_loss(head, tokens, h, vocab) -> None:
    """Where the memory of one step goes: the head and loss keep their input, the head's input and the FP32
    log-probabilities, 4·(2·h + V) bytes a token, plus LayerNorm's statistics and the targets"""
    model = 4 * tokens * (2 * h + vocab)
    assert model <= head <= 1.05 * model, (head, model)
    assert h == vocab                                          # the text: the three parts are equal here


def check_logits_against_a_layer(s, h) -> None:
    """Where the memory of one step goes: at GPT-3 scale the FP32 log-probabilities are about half a layer's linear part
    at V = 50,257 and 1.4× it at V = 150,000"""
    layer = 34 * s * h
    assert round(4 * s * 50257 / layer, 1) == 0.5 and round(4 * s * 150000 / layer, 1) == 1.4


def check_activations_per_block_formula_measurement(rows) -> None:
    """Activations per block: the formula and the measurement"""
    assert all(abs(got - want) <= 0.01 * want for _, _, got, want, _ in rows)


def check_over_sequence_length(sweep) -> None:
    """Over the sequence length"""
    assert all(abs(got - lin - quad) <= 0.01 * (lin + quad) for got, lin, quad in sweep.values())
    assert 2 < sweep[128][0] / sweep[64][0] < sweep[512][0] / sweep[256][0] < 4 and sweep[512][2] > 0.8 * sum(sweep[512][1:])


def check_attention_without_matrix(fused) -> None:
    """Attention without the s×s matrix"""
    assert all(same and (u, f, lse) == m for u, f, m, same, _, lse in fused.values())


def check_how_built(identical) -> None:
    """How it is built"""
    assert all(identical.values())


def check_what_costs_flops(flops, cfg, B, S, H, L, block_forward, step_model) -> None:
    """What it costs: FLOPs"""
    assert flops["selective"] - flops["none"] == cfg.n_layer * 2 * B * S * S * H and flops["full"] - flops["none"] == L * block_forward
    assert flops["none"] == step_model and flops["none"] < flops["selective"] < flops["full"]


def check_attention_share_of_flops(s_, h_, layer) -> None:
    """What it costs: FLOPs"""
    assert 2 * s_ * s_ * h_ / layer < 0.01 < 12 * s_ * s_ * h_ / layer < 0.05


def check_one_steps_memory_as_timeline(peaks) -> None:
    """One step's memory as a timeline"""
    assert peaks["full"] < peaks["selective"] < peaks["none"]


def check_same_communication(per_rank) -> None:
    """Per rank, under data parallelism: same communication"""
    assert all(per_rank[m][0][1] == per_rank["none"][0][1] for m in MODES)          # same communication
    assert per_rank["full"][0][0] < per_rank["selective"][0][0] < per_rank["none"][0][0]
    assert all(torch.equal(a, b) for a, b in zip(per_rank["full"][0][2], per_rank["none"][0][2]))


def check_peak_below_sum(acc) -> None:
    """Where the memory of one step goes: the peak is below the sum of the parts"""
    assert acc.peak < acc.params + acc.grads + acc.optimizer + acc.activations      # not all alive at once
    assert acc.peak > acc.params + acc.optimizer + acc.activations                  # the forward's end, grads not yet made


def check_step_times(seconds) -> None:
    """What it costs: time, every mode timed in the same rounds"""
    assert set(seconds) == set(MODES) and len({len(t) for t in seconds.values()}) == 1
    assert all(t and min(t) > 0 for t in seconds.values())


def check_gpt3_dial(kept, extra, layer) -> None:
    """Choosing what to recompute: at GPT-3's shape"""
    assert kept["full"] < kept["selective"] < kept["none"]
    assert kept["none"] - kept["selective"] > kept["selective"]       # the s² terms are most of the layer's bytes
    assert extra["selective"] / layer < 0.01 and abs(extra["full"] / layer - 1 / 3) < 1e-12


def check_gpt3_crossing(crossing, ratio) -> None:
    """Over the sequence length, at GPT-3's shape: the s² part overtakes at s ≈ 870, and is 2.4× at s = 2048"""
    assert round(crossing) == 870 and round(ratio, 1) == 2.4


def check_segments(peaks, n_layers, kept, rebuilt, layer_input) -> None:
    """Choosing what to recompute: √n checkpointing. With a checkpoint every k layers the peak is
    ⌈n/k⌉ inputs + k whole layers; a GPT-3 layer keeps 57× its input, so k = 1 beats k ≈ √n; with selective
    recomputation it keeps 17×, plus one layer's s² terms (40× its input) rebuilt in that layer's backward.
    So at k = 1 selective inside peaks as high as without it (7.2 GiB), and k = 2 wins (5.7 GiB)"""
    best = {mode: min(p, key=p.get) for mode, p in peaks.items()}
    assert best["none"] == 1 and peaks["none"][round(n_layers ** 0.5)] > 3 * peaks["none"][1], peaks
    assert best["selective"] == 2, peaks
    assert round(kept["none"] / layer_input) == 57 and round(kept["selective"] / layer_input) == 17
    assert rebuilt == kept["none"] - kept["selective"] and round(rebuilt / layer_input) == 40
    assert peaks["selective"][1] == peaks["none"][1] and round(peaks["none"][1] / 2 ** 30, 1) == 7.2, peaks
    assert round(peaks["selective"][2] / 2 ** 30, 1) == 5.7 and round(peaks["selective"][4] / 2 ** 30, 1) == 6.2, peaks


def check_per_block_modes(runs) -> None:
    """Choosing what to recompute under a budget: one mode per block lands between all-none and all-full in
    peak memory and in FLOPs"""
    mix = [m for m in runs if m not in ("none", "full")]
    assert mix and all(runs["full"][0] < runs[m][0] < runs["none"][0] for m in mix), runs
    assert all(runs["none"][1] < runs[m][1] < runs["full"][1] for m in mix), runs

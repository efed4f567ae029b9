"""Chapter 08's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import torch

from minipar.course.ch08_hybrid_parallelism import measure


def check_mesh_groups(mesh) -> None:
    """The mesh and its groups"""
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]] and mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def check_tp_stays_neighbours_either_way(megatron_order, mesh) -> None:
    """The mesh and its groups: TP stays on neighbours either way"""
    assert megatron_order.groups("tp") == mesh.groups("tp")                 # TP stays on neighbours either way
    assert megatron_order.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # now the pipeline takes the far hop


def check_global_batch_loss(B, dp, m) -> None:
    """The global batch and the loss"""
    assert B == dp * m * (B // (dp * m))


def check_k_bias_gradient_is_zero(k, q) -> None:
    """A gradient that is exactly zero: the K part of the fused QKV bias, up to rounding (the Q part is not)"""
    assert k.abs().max() < 1e-15 < 1e-8 < q.abs().max()


def check_kinds_at_scale(tp_values, pp_values, dp_values, t, seconds, step_seconds, value_bytes, grad_bytes) -> None:
    """Per step and per rank, on the 1T layout: TP sends by far the most ("over a terabyte", "a few seconds" of
    a step of about 100 s on NVLink, "tens" on InfiniBand); PP sends more than DP: 53.7 billion values against
    3.3 billion, and "about twice DP's bytes" even at 1/t (scatter/gather) with 16-bit gradients (FP16 run);
    PP at 1/t and DP each take "under a second" on InfiniBand"""
    assert tp_values > pp_values > pp_values / t > dp_values
    assert 1.8 < pp_values / t * value_bytes / (dp_values * grad_bytes) < 2.2 and max(seconds["DP on IB"], seconds["PP at 1/t on IB"]) < 1
    assert 1000 < tp_values * 2 / 1e9 < 2000 and 1 < seconds["TP on NVLink"] < 5 and 10 < seconds["TP on IB"] < 100
    assert round(pp_values / 1e9, 1) == 53.7 and round(dp_values / 1e9, 1) == 3.3
    assert 90 < step_seconds < 110 and 0.4 < seconds["PP at 1/t on IB"] < 0.6
    # §4's verdict: TP needs NVLink; PP's and DP's order barely matters (each under 1 % of the step on IB)
    assert seconds["TP on IB"] - seconds["TP on NVLink"] > seconds["PP at 1/t on IB"] + seconds["DP on IB"]
    assert max(seconds["PP at 1/t on IB"], seconds["DP on IB"]) < 0.01 * step_seconds


def check_memory_per_layout(memory) -> None:
    """The layouts compared: 4×2×1 keeps the most per rank, 1×2×4 the least; ZeRO-1 shrinks the model states"""
    for i in (0, 1):                                     # the peak, and the model states
        by = {name: m[i] for name, m in memory.items() if name != "2x2x2+zero1"}
        assert max(by, key=by.get) == "4x2x1" and min(by, key=by.get) == "1x2x4"
    assert memory["2x2x2+zero1"][1] < memory["2x2x2"][1]


def check_same_order(memory, formula) -> None:
    """The layouts compared: the toy's measured model states rank the four layouts as the 1B formula does"""
    assert sorted(memory, key=lambda n: memory[n][1]) == sorted(formula, key=formula.get), (memory, formula)


def check_layout_bytes_equal_formula(name, logged, formula) -> None:
    """The layouts compared: every rank's communication log equals the byte formula, kind by kind"""
    assert logged == {k: formula[k] for k in logged}, (name, logged, formula)


def check_bytes_per_layout(sent) -> None:
    """The layouts compared: 1×2×4 buys its memory with the most TP bytes; 4×2×1 sends no TP bytes and the
    most DP bytes; 1×2×4 has no DP to send"""
    plain = {name: b for name, b in sent.items() if name != "2x2x2+zero1"}
    assert max(plain, key=lambda n: plain[n]["tp"]) == "1x2x4" and sent["4x2x1"]["tp"] == 0
    assert max(plain, key=lambda n: plain[n]["dp"]) == "4x2x1" and sent["1x2x4"]["dp"] == 0
    assert sent["1x2x4"]["tp"] > sent["2x2x2"]["tp"] + sent["2x2x2"]["dp"]     # more sent than 2x2x2 in all


def check_layouts_compared(psi) -> None:
    """The layouts compared"""
    assert measure.layout_memory_formula(psi, dp=2, pp=2, tp=2, zero=1) < measure.layout_memory_formula(psi, dp=2, pp=2, tp=2)


def check_checkpoint_that_changes_layout(saved, out) -> None:
    """A checkpoint that changes layout"""
    assert all(step == 2 and all(torch.equal(t, saved[n]) for n, t in params.items()) for _, step, params in out)


def check_zero1_peak_drop(memory) -> None:
    """The layouts compared: ZeRO-1's peak falls by about twice its model states' fall — Adam's m and v, and
    the optimizer step's temporaries, which scale with the elements it steps, both on half the elements"""
    states_drop = memory["2x2x2"][1] - memory["2x2x2+zero1"][1]
    peak_drop = memory["2x2x2"][0] - memory["2x2x2+zero1"][0]
    assert 0 < states_drop and 1.8 * states_drop <= peak_drop <= 2.2 * states_drop


def check_zero1_states_fall(fall) -> None:
    """ZeRO-1's model states: a quarter measured (float64: value, gradient, m, v; two of the four halved), 37.5 %
    by the formula (mixed precision: 2 + 2 + 12 bytes, the 12 of master, m and v halved)"""
    assert abs(fall["measured"] - 0.25) < 0.01 and fall["formula"] == 0.375, fall


def check_1t_agrees_with_chapter_12(ours, p) -> None:
    """§4's 1T numbers against chapter 12b's planner on the same run (the same library call and inputs as its
    ``oneflow_layout``): TP's bytes equal; PP's middle stage is the planner's mean over the p stages × p/(p−1)
    (the end stages cross one boundary); DP's middle stage is at most the planner's fullest stage (the
    embedding's) and within 15 % of it; the step of the paper's measured rate (103 s) within 10 % of the
    planner's (96 s); TP's seconds at full NVLink bandwidth a lower bound on the planner's, within 2×"""
    planner = measure.one_t_as_chapter_12_prices_it()
    sent = planner.bytes_sent
    assert abs(ours["tp"] / sent["tp"] - 1) < 1e-9, (ours["tp"], sent["tp"])
    assert abs(ours["pp"] / (sent["pp"] * p / (p - 1)) - 1) < 1e-9, (ours["pp"], sent["pp"])
    assert 0.85 * sent["dp"] < ours["dp"] <= sent["dp"], (ours["dp"], sent["dp"])
    assert abs(ours["step"] / planner.step_seconds - 1) < 0.10, (ours["step"], planner.step_seconds)
    assert ours["tp_nvlink"] <= planner.time["tp"] < 2 * ours["tp_nvlink"], (ours["tp_nvlink"], planner.time["tp"])


def check_zero_per_microbatch(r) -> None:
    """§5's table, per micro-batch: ZeRO-2 sends (m+1)/2 and ZeRO-3 3m/2 times ZeRO-1's bytes"""
    assert r.rs[2] == r.m * r.rs[1] and r.per_mb[2]["by_op"]["reduce_scatter"][0] == r.m   # m calls, m× the bytes
    assert r.per_mb[2]["by_op"]["all_gather"] == r.per_mb[1]["by_op"]["all_gather"]    # + the step's all-gather
    assert 2 * r.per_mb[2]["bytes"] == (r.m + 1) * r.per_mb[1]["bytes"]                 # (m+1)/2 × ZeRO-1's bytes
    assert 2 * r.per_mb[3]["bytes"] == 3 * r.m * r.per_mb[1]["bytes"]                   # ZeRO-3: 3m/2 × ZeRO-1's


def check_zero_once(r) -> None:
    """§5's table, once per step: ZeRO-1's calls and bytes, one device's result, less held between steps"""
    once = r.once
    assert all(c["matches"] for c in once.values())
    assert once[2]["calls"] == once[3]["calls"] == once[1]["calls"] and once[3]["bytes"] == once[1]["bytes"] == r.rs1 * 2
    assert once[3]["between"] < once[2]["between"] < once[1]["between"]
    # ZeRO-2 frees the gradient buffer outside its shard (on dp = 2, half the buffer: ZeRO-1's reduce-scatter
    # bytes), which minipar's ZeRO-1 keeps until zero_grad; ZeRO-3 also frees the parameters outside its shard
    assert once[1]["between"] - once[2]["between"] == r.rs1 == once[2]["between"] - once[3]["between"]
    assert all(once[z]["bytes"] < r.per_mb[z]["bytes"] for z in (2, 3))       # the two tables' trade
    assert once[1]["peak"] < once[2]["peak"] < once[3]["peak"]    # minipar's step peak: how it allocates shards
    # minipar's copies (not ZeRO's): ZeRO-2's peak is one shard (its gradient's copy) above ZeRO-1's, ZeRO-3's two
    # (also its parameters' master shard beside the gathered parameters); a shard is ZeRO-1's reduce-scatter bytes
    assert once[2]["peak"] - once[1]["peak"] == r.rs1 and once[3]["peak"] - once[1]["peak"] == 2 * r.rs1
    # held between steps at dp = 2, in units of ZeRO-1's bytes sent (one stage's parameters): ZeRO-1 holds params +
    # grads + half of m, v = 3; ZeRO-2 half the grads = 2.5; ZeRO-3 half the params too = 2; plus the step count
    one = r.per_mb[1]["bytes"]
    assert [once[z]["between"] - 4 for z in (1, 2, 3)] == [3 * one, 2.5 * one, 2 * one]

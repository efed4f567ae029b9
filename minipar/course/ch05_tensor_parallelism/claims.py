"""Chapter 05's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations


import torch
import torch.nn.functional as F
from minipar.wire import GLOO_HEADER_BYTES     # gloo's TCP transport: a header per write


def check_y_gelu_xa_with_split(shards, x, a) -> None:
    """Y = GeLU(XA), with A split by columns"""
    assert torch.allclose(torch.cat([y for _, y in shards], dim=1), F.gelu(x @ a), atol=1e-6)


def check_gelu_does_not_add_up(sums_add_up, gelus_add_up) -> None:
    """Y = GeLU(XA), with A split by columns"""
    assert sums_add_up and not gelus_add_up


def check_mlp_column_parallel_then_row(r) -> None:
    """The MLP: column-parallel, then row-parallel"""
    assert r["max |y - y_ref|"] < 1e-6 and r["max |dX - dX_ref|"] < 1e-6
    assert r["forward"]["all_reduce"][0] == 1 and r["backward"]["all_reduce"][0] == 1


def check_attention_heads_split_across_ranks(heads, qkv_shape, diff) -> None:
    """Attention: heads split across ranks"""
    assert heads == 2 and qkv_shape == (24, 32) and diff < 1e-6


def check_vocabulary_split_embedding_cross_entropy(got, want, calls, sent) -> None:
    """The vocabulary, split: embedding and cross-entropy"""
    assert abs(got - want) < 1e-12 and calls == 3 and sent == 2 * 3 / 4 * (32 + 32 + 2 * 32) * 8


def check_vocabulary_parallel_embedding(gaps) -> None:
    """The vocabulary-parallel embedding's lookup equals nn.Embedding's exactly (one non-zero row summed with zeros)"""
    assert gaps and all(gap == 0 for gap in gaps.values())


def check_whole_gpt_tensor_parallel_against(refused) -> None:
    """The whole GPT, tensor-parallel, against one device"""
    assert refused is not None




def check_bytes_per_layer(layer) -> None:
    """Bytes per layer: the log equals the formula; the wire adds whole 48-byte headers, under 2 KiB a call: gloo's
    framing, 3 headers (144 B) a message, on the 4(t-1) messages of each gloo all-reduce (two segments a rank)"""
    for t, (sent, observed, formula) in layer.items():
        assert sent["bytes_sent"] == formula < observed <= formula + 4 * 2048
        assert (observed - formula) % GLOO_HEADER_BYTES == 0
        calls = sent["by_op"]["all_reduce"][0]
        assert observed - formula == 3 * GLOO_HEADER_BYTES * 4 * (t - 1) * calls, (t, observed - formula, calls)


def check_memory_per_rank_measured(mem, fraction) -> None:
    """Memory per rank, measured"""
    assert all(r["param_bytes"] == r["param_formula"] and r["activation_bytes"] == r["activation_formula"] for r in mem.values()) and 0.25 < fraction < 0.5
    assert round(mem[1]["param_bytes"] / mem[4]["param_bytes"], 1) == 3.8     # the prose: "÷3.8 at t = 4"
    assert round(fraction, 2) == 0.42                                          # the prose: "about 0.42"


def check_inside_node_small_tax(inside, across) -> None:
    """Why TP stays inside a node: inside a node: a small tax"""
    assert all(inside[t]["tp_share"] < 0.2 for t in (2, 4, 8))                       # inside a node: a small tax
    for t in (4, 8):                                                                 # across: a large one
        assert across[t]["tp_share"] > 2 * inside[t]["tp_share"]
        assert across[t]["tokens_per_gpu"] < 0.9 * inside[t]["tokens_per_gpu"]
    assert inside[16]["tp_share"] > 2 * inside[8]["tp_share"]                        # 16 spans two nodes, on 8 rails
    assert inside[16]["tokens_per_gpu"] < 0.8 * inside[8]["tokens_per_gpu"]


def check_t1_does_not_fit(state, card_gb) -> None:
    """Why TP stays inside a node: at t = 1 the weights and Adam state alone exceed one card, at t = 2 they fit"""
    assert state[1] > card_gb > state[2]


def check_weight_state_product(gb, layers, params) -> None:
    """Deeper B: the t = 1 bytes printed as layers × parameters × 16 B are that product"""
    assert abs(gb - layers * params * 16 / 1e9) < 1e-6


def check_crossing_costs_with_narrow_matmuls(slow) -> None:
    """Why TP stays inside a node: with narrow matmuls slower, crossing nodes (t = 8 -> 16) still costs a GPU
    over a fifth of its tokens/s"""
    assert slow[16] < 0.8 * slow[8]


def check_why_tp_stays_inside_node(by_t) -> None:
    """Why TP stays inside a node"""
    assert [by_t[t]["tokens_per_gpu"] for t in by_t] == sorted((by_t[t]["tokens_per_gpu"] for t in by_t), reverse=True)


def check_every_run_trains_as_one_device(equal) -> None:
    """The chapter's own GPT on an H100 node: every run trains as one device does, at every t"""
    assert all(c.matches for cs in equal.values() for c in cs)


def check_matmuls_flops_fall_as_1_t(flops, inside, gemm, floor, compute) -> None:
    """The chapter's own GPT on an H100 node: the matmuls' FLOPs fall as 1/t ..."""
    assert all(abs(flops[t] * t / flops[1] - 1) < 0.01 for t in inside)   # the matmuls' FLOPs fall as 1/t ...
    assert [gemm[t] for t in inside] == sorted(gemm.values(), reverse=True)   # ... and their time with them

    assert all(floor[t] == floor[1] for t in inside)                      # ... the kernels do not: the same launches at every t
    assert all(floor[t] > 0.9 * compute[t] for t in inside)               # launch-bound: the floor is most of the compute
    assert all(compute[t] <= 1.001 * compute[1] for t in inside)          # so compute per rank barely falls — and never rises
    assert all(row["ratio"] < 1 for row in inside.values())               # inside a node: TP comm below compute at t ≤ 8
    saved = compute[1] - min(compute.values())
    assert all(row["comm"] > 10 * saved for t, row in inside.items() if t > 1)   # the all-reduces add far more than splitting saves


def check_matmuls_memory_bound(gemm, at_hbm, flops, top) -> None:
    """Deeper A: at this size the matmuls are memory-bound (their time is their bytes at HBM speed), so their time
    falls less than their FLOPs"""
    assert all(abs(at_hbm[t] / gemm[t] - 1) < 0.01 for t in gemm)
    assert gemm[1] / gemm[top] < flops[1] / flops[top]


def check_across_nodes_more_than_twice_inside(tables, t) -> None:
    """The chapter's own GPT on an H100 node: across nodes: more than twice inside"""
    assert tables[t]["across"]["comm"] > 2 * tables[t]["inside"]["comm"]


def check_pytorchs_own_tp_api_side(dy, dw) -> None:
    """PyTorch's own TP API, side by side"""
    assert dy < 1e-6 and dw < 1e-6


def check_whole_plus_split(whole, split, formula_t4, layernorm_io_bytes) -> None:
    """Memory per rank, measured: the activation formula is W + S/t (t = 4 from t = 1 and 2), and W holds at least the
    LayerNorms' inputs and outputs (4·b·s·h values)"""
    assert abs(whole + split / 4 - formula_t4) < 1, (whole, split, formula_t4)
    assert whole >= layernorm_io_bytes and split > 0


def check_planner_numbers_quoted(h100, keep) -> None:
    """Why TP stays inside a node (Deeper B, Summary): the planner's H100 numbers the prose quotes: the all-reduces take
    16% of the step at t = 8 and 36% at t = 16; t = 8 keeps 78% of t = 2's tokens/s per GPU for a 3.1x shorter
    step, t = 16 keeps 51%"""
    quoted = (f"{h100[8]['tp_share']:.0%}", f"{h100[16]['tp_share']:.0%}", f"{keep[8]:.0%}", f"{keep[16]:.0%}",
              f"{h100[2]['step'] / h100[8]['step']:.1f}")
    assert quoted == ("16%", "36%", "78%", "51%", "3.1"), quoted

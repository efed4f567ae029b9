"""Chapter 06's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

from minipar.activations import activation_bytes_formula
from minipar.tensor.sequence import korthikanti_bytes


def check_what_tensor_parallelism_leaves_whole(s, b, h, a) -> None:
    """What tensor parallelism leaves whole"""
    assert all(activation_bytes_formula(s, b, h, a, t=t) == korthikanti_bytes(s, b, h, a, t) for t in (1, 2, 4, 8))
    assert 0.4 < 10 * s * b * h / korthikanti_bytes(s, b, h, a, 8) < 0.5    # at t = 8, almost half is left whole


def check_sp_divides_everything_by_t(s, b, h, a) -> None:
    """What SP saves: with SP, everything one layer keeps is divided by t"""
    assert all(korthikanti_bytes(s, b, h, a, t, True) == korthikanti_bytes(s, b, h, a, 1) / t for t in (2, 4, 8))


def check_sp_frees(freed, whole, n_layer) -> None:
    """What tensor parallelism leaves whole: SP at t = 8 frees 7/8 of the 10·sbh (about 20 GiB over GPT-3's
    96 layers per sequence)"""
    assert freed == whole * 7 / 8 and 19 < n_layer * freed / 2**30 < 21, freed


def check_scores_term_outgrows_what_sp_frees(scores, freed, s, b, h) -> None:
    """SP does not shrink the attention term 5as²b/t further: at t = 8 and s = 2048 it is 10·sbh, more than the
    8.75·sbh SP frees"""
    assert scores == 10 * s * b * h and freed == 8.75 * s * b * h and scores > freed


def check_scores_dominate_after_sp(share, s, b, h, a) -> None:
    """What SP saves: the s² attention term, 5as/h = 80 against 34 at GPT-3's shape, is about 70% of what a
    layer keeps under TP + SP, whatever t is"""
    assert all(abs(5 * a * s * s * b / t / korthikanti_bytes(s, b, h, a, t, True) - share) < 1e-12 for t in (2, 4, 8))
    assert 0.69 < share < 0.71, share


def check_sp_lengthens_sequence_by_about_a_third(longest, s) -> None:
    """What SP saves: in TP's memory at t = 8, TP+SP fits a sequence about a third longer, far from t-fold"""
    assert 1.25 < longest / s < 1.4, longest


# gloo frames each message it writes with a header, and a call writes several messages (how many depends on
# the collective), so only a bound per logged call holds for the socket bytes
FRAMING_BOUND_PER_CALL = 2048


def check_activations_measured(rows) -> None:
    """The memory: activations measured = the paper's count (+ what it leaves out), and SP keeps less at every t"""
    assert all(r["activation_bytes"] == r["formula_bytes"] for r in rows)
    assert all(rows_t[True]["activation_bytes"] < rows_t[False]["activation_bytes"]
               for rows_t in ({r["sp"]: r for r in rows if r["t"] == t} for t in {r["t"] for r in rows}))


def check_three_ways(ways, regather) -> None:
    """The bytes: an all-reduce *is* a reduce-scatter plus an all-gather. The communication log counts exactly
    the formula's bytes; TP+SP sends TP's plus the two re-gathers (48 + 12 KiB at t = 4); keeping the gathered
    inputs sends TP's bytes again and keeps the re-gathers' bytes as activations. The sockets carry the log's
    bytes plus gloo's message headers"""
    tp, sp, kept = ways["TP"], ways["TP+SP"], ways["TP+SP, inputs kept"]
    for name, w in ways.items():
        assert w["log"] == w["formula"], (name, w)                                # the log = the formula, exactly
        assert w["log"] <= w["wire"] <= w["log"] + FRAMING_BOUND_PER_CALL * w["calls"], (name, w)
    assert tp["formula"] == 48 * 1024 and regather == 12 * 1024                  # the prose's 48 + 12 KiB
    assert sp["formula"] == tp["formula"] + regather and kept["formula"] == tp["formula"]
    assert regather <= sp["wire"] - kept["wire"] <= regather + 2 * FRAMING_BOUND_PER_CALL   # the wire: the re-gathers
    assert kept["activations"] - sp["activations"] == regather                  # ... paid for in activation memory
    assert sp["activations"] < kept["activations"] < tp["activations"]


def check_layernorm_gradients_now_partial(wrong) -> None:
    """LayerNorm gradients are now partial"""
    assert not wrong.matches


def check_dropout_masks_that_agree_masks(rep0, rep1, own0, own1) -> None:
    """Dropout: masks that agree, masks that differ"""
    assert rep0 == rep1 and own0 != own1


def check_sequence_shards_draw_their_own_masks(by_rank, one_seed) -> None:
    """Under SP the residual dropout acts on different tokens on each rank: by the per-rank stream two shards'
    masks agree about as often as independent ones (0.9² + 0.1² = 0.82 at p = 0.1); one seed on every shard
    repeats one pattern (agreement 1)"""
    assert abs(by_rank - 0.82) < 0.02 and one_seed == 1.0


def check_replicas_drift_seeded_by_rank(right, wrong) -> None:
    """Break the rule and nothing fails: by Megatron's rule the TP ranks' replicated parameters stay equal bit
    for bit; with the replicated stream seeded by rank they drift apart within two steps"""
    assert right == 0.0 and wrong > 1e-3


def check_whole_gpt_with_tp_sp(refused) -> None:
    """The whole GPT with TP + SP, against one device"""
    assert refused is not None


def check_pytorchs_sequence_parallelism_side_by(shape, dy, db, placement) -> None:
    """PyTorch's sequence parallelism, side by side: the same output shard, and the same bias gradient, which
    DTensor has already summed over the group in backward (Replicate; its local tensor is the whole sum)"""
    assert shape == (2, 4, 32) and dy < 1e-6 and db < 1e-5 and placement == "Replicate"


def check_fused_attention_about_three_times(ratio) -> None:
    """Fused attention, t = 8: TP's (10 + 24/t)·sbh over TP+SP's 34/t·sbh, plus the log-sum-exp, ≈ 3 (the prose)"""
    assert 2.9 < ratio < 3.1, ratio

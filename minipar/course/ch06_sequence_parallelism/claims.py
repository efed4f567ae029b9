"""Chapter 06's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

from minipar.activations import activation_bytes_formula
from minipar.tensor.sequence import korthikanti_bytes


def check_what_tensor_parallelism_leaves_whole(s, b, h, a) -> None:
    """What tensor parallelism leaves whole"""
    assert all(activation_bytes_formula(s, b, h, a, t=t) == korthikanti_bytes(s, b, h, a, t) for t in (1, 8))
    assert korthikanti_bytes(s, b, h, a, 8, True) == korthikanti_bytes(s, b, h, a, 1) / 8


def check_bytes_all_reduce_reduce_scatter(rows, by, regather) -> None:
    """The bytes: an all-reduce *is* a reduce-scatter plus an all-gather"""
    assert all(r["bytes_sent"] == r["bytes_formula"] and r["activation_bytes"] == r["formula_bytes"] for r in rows)
    assert all(by[t, True]["bytes_sent"] == by[t, False]["bytes_sent"] + regather[t]
               and by[t, True]["activation_bytes"] < by[t, False]["activation_bytes"] for t in (2, 4))


def check_model_48_48_12_48_48(kept, ring, tp, sp, regather) -> None:
    """Keeping the gathered inputs: the same bytes as TP, for memory: the model: 48, 48 + 12, 48, 48"""
    assert kept[0] == ring[0] == tp[0] and sp[0] == tp[0] + regather      # the model: 48, 48 + 12, 48, 48
    assert regather <= sp[1] - kept[1] <= regather + 2 * 2048             # the wire: the re-gathers (+ headers)
    assert tp[0] <= ring[1] <= tp[1]                                       # the wire: TP's bytes, up to headers
    assert kept[3] - sp[3] == regather                                     # ... paid for in activation memory


def check_layernorm_gradients_now_partial(wrong) -> None:
    """LayerNorm gradients are now partial"""
    assert not wrong.matches


def check_dropout_masks_that_agree_masks(rep0, rep1, own0, own1) -> None:
    """Dropout: masks that agree, masks that differ"""
    assert rep0 == rep1 and own0 != own1


def check_whole_gpt_with_tp_sp(refused) -> None:
    """The whole GPT with TP + SP, against one device"""
    assert refused is not None


def check_pytorchs_sequence_parallelism_side_by(shape, dy, db) -> None:
    """PyTorch's sequence parallelism, side by side"""
    assert shape == (2, 4, 32) and dy < 1e-6 and db < 1e-5

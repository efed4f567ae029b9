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


FRAMING_PER_COLLECTIVE = 2048   # bytes of gloo message headers one small collective may add on the wire


def check_bytes_all_reduce_reduce_scatter(rows, traffic, formula, regather) -> None:
    """The bytes: an all-reduce *is* a reduce-scatter plus an all-gather. Activations measured = the paper's
    count (+ what it leaves out); on the wire (t = 4) each rank carries the formula's bytes plus headers, and
    TP+SP carries TP's plus the two re-gathers"""
    assert all(r["activation_bytes"] == r["formula_bytes"] for r in rows)
    assert all(rows_t[True]["activation_bytes"] < rows_t[False]["activation_bytes"]
               for rows_t in ({r["sp"]: r for r in rows if r["t"] == t} for t in (2, 4)))
    for name in ("TP", "TP+SP"):
        calls, wire = traffic[name][2], traffic[name][1]
        assert formula[name] <= wire <= formula[name] + FRAMING_PER_COLLECTIVE * calls, (name, wire, formula[name])
    assert formula["TP+SP"] == formula["TP"] + regather[4]
    headers = (traffic["TP+SP"][1] - formula["TP+SP"]) - (traffic["TP"][1] - formula["TP"])
    assert abs(headers) <= 4 * FRAMING_PER_COLLECTIVE, headers      # wire − formula about the same for both


def check_model_48_48_12_48_48(kept, tp, sp, regather) -> None:
    """Keeping the gathered inputs: the same bytes as TP, for memory: on the wire 48, 48 + 12, 48 (+ headers)"""
    assert regather <= sp[1] - kept[1] <= regather + 2 * FRAMING_PER_COLLECTIVE   # the wire: the re-gathers
    assert abs(kept[1] - tp[1]) <= 4 * FRAMING_PER_COLLECTIVE                  # the wire: TP's bytes, up to headers
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

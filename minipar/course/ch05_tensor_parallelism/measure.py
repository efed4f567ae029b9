"""Chapter 05's memory per rank, from live tensors: one transformer layer split t ways, its parameters
(what the rank's modules hold) and the activations autograd keeps for backward, both measured by
:func:`minipar.tensor.measure.measure_layer`, beside the formulas.

Formulas (per layer, float32 here; h hidden, a heads, s sequence, b batch):

* parameters ``(12h² + 7h)/t + 6h`` values: the QKV, projection, fc and proj weights and the column-parallel
  biases are split; the two LayerNorms (4h) and the two row-parallel biases (2h) are whole on every rank;
* activations: Korthikanti et al.'s count (:func:`minipar.activations.activation_bytes_formula`, 4-byte
  values, no dropout) plus what PyTorch keeps that it leaves out
  (:func:`minipar.tensor.sequence.uncounted_bytes`).
"""
from __future__ import annotations

from minipar.launcher import launch

__all__ = ["memory_per_degree", "param_values_formula", "layer_bytes"]


def param_values_formula(h: int, t: int) -> float:
    """Parameters one rank holds for one layer: the split matrices and column biases /t, the rest whole."""
    return (12 * h * h + 7 * h) / t + 6 * h


def memory_per_degree(degrees=(1, 2, 4), b: int = 4, s: int = 16, h: int = 32, a: int = 4) -> list:
    """[{"t", "param_bytes", "param_formula", "activation_bytes", "activation_formula"}], one launch per
    degree; measured values are the maximum over the ranks (all equal here)."""
    from minipar.models import GPTConfig
    from minipar.tensor.measure import measure_layer
    from minipar.activations import activation_bytes_formula
    from minipar.tensor.sequence import uncounted_bytes

    rows = []
    for t in degrees:
        per_rank = launch(measure_layer, t, GPTConfig(n_embd=h, n_head=a), b, s, quiet=True)
        rows.append({"t": t,
                     "param_bytes": max(r["param_bytes"] for r in per_rank),
                     "param_formula": 4 * param_values_formula(h, t),
                     "activation_bytes": max(r["activation_bytes"] for r in per_rank),
                     "activation_formula": activation_bytes_formula(s, b, h, a, t=t, value_bytes=4, dropout=False)
                     + uncounted_bytes(s, b, t)})
    return rows


def layer_bytes(degrees=(2, 4), b: int = 4, s: int = 16, h: int = 32, a: int = 4) -> dict:
    """{t: (rank 0's communication log of one layer's forward and backward {"bytes_sent", "by_op"}, the bytes
    each rank wrote to its sockets for it (mean over ranks), the formula 4 · 2(t-1)/t · b·s·h·4)}."""
    from minipar.course.tp_layer import measure_layer_on_wire
    from minipar.models import GPTConfig
    from minipar.tensor.measure import measure_layer
    from minipar.tensor.sequence import tp_bytes_per_layer

    out = {}
    for t in degrees:
        sent = launch(measure_layer, t, GPTConfig(n_embd=h, n_head=a), b, s, False, quiet=True)[0]
        wire = launch(measure_layer_on_wire, t, GPTConfig(n_embd=h, n_head=a), False, False, b, s, quiet=True)
        out[t] = (sent, sum(r[1] for r in wire) / t, tp_bytes_per_layer(s, b, h, t))
    return out

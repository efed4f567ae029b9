"""Chapter 05's memory per rank, from live tensors: one transformer layer split t ways, its parameters
(what the rank's modules hold) and the activations autograd keeps for backward
(:func:`minipar.memory.saved_activation_bytes`), beside the formulas.

Formulas (per layer, float32 here; h hidden, a heads, s sequence, b batch):

* parameters ``(12h² + 7h)/t + 6h`` values: the QKV, projection, fc and proj weights and the column-parallel
  biases are split; the two LayerNorms (4h) and the two row-parallel biases (2h) are whole on every rank;
* activations: Korthikanti et al.'s count (:func:`minipar.tensor.sequence.activation_bytes_formula`, 4-byte
  values, no dropout) plus what PyTorch keeps that it leaves out
  (:func:`minipar.tensor.sequence.uncounted_bytes`).
"""
from __future__ import annotations

from minipar.launcher import launch

__all__ = ["layer_memory", "memory_per_degree", "param_values_formula"]


def param_values_formula(h: int, t: int) -> float:
    """Parameters one rank holds for one layer: the split matrices and column biases /t, the rest whole."""
    return (12 * h * h + 7 * h) / t + 6 * h


def layer_memory(rank, world_size, cfg, b, s, seed=0) -> dict:
    """One TP layer on this rank: bytes of its parameters and of the activations saved for backward."""
    import torch

    from minipar.memory import saved_activation_bytes
    from minipar.mesh import Mesh
    from minipar.models import Block
    from minipar.tensor.gpt import TensorParallelBlock
    from minipar.tensor.layers import DropoutStreams

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    torch.manual_seed(seed)
    block = TensorParallelBlock(Block(cfg), group, False, DropoutStreams(seed, group))
    params = sum(p.numel() * p.element_size() for p in block.parameters())
    x = torch.randn(b, s, cfg.n_embd, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    y, activations = saved_activation_bytes(block, x, exclude=list(block.parameters()))
    y.backward(torch.ones_like(y))
    return {"param_bytes": params, "activation_bytes": activations}


def memory_per_degree(degrees=(1, 2, 4), b: int = 4, s: int = 16, h: int = 32, a: int = 4) -> list:
    """[{"t", "param_bytes", "param_formula", "activation_bytes", "activation_formula"}], one launch per
    degree; measured values are the maximum over the ranks (all equal here)."""
    from minipar.models import GPTConfig
    from minipar.tensor.sequence import activation_bytes_formula, uncounted_bytes

    rows = []
    for t in degrees:
        per_rank = launch(layer_memory, t, GPTConfig(n_embd=h, n_head=a), b, s, quiet=True)
        rows.append({"t": t,
                     "param_bytes": max(r["param_bytes"] for r in per_rank),
                     "param_formula": 4 * param_values_formula(h, t),
                     "activation_bytes": max(r["activation_bytes"] for r in per_rank),
                     "activation_formula": activation_bytes_formula(s, b, h, a, t, value_bytes=4, dropout=False)
                     + uncounted_bytes(s, b, t)})
    return rows

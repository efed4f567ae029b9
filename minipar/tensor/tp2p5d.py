"""2.5D tensor parallelism: Tesseract (Wang et al. 2021, "Tesseract: Parallelize the Tensor Parallelism
Efficiently"), on d stacked q×q layers (P = d·q²).

Layout on rank (k, i, j) — depth k, grid position (i, j):

* the input X (tokens × features) is cut into d·q row blocks and q column blocks; rank (k, i, j) holds
  X_(kq+i), j — each depth layer has its own 1/d of the tokens;
* the weight A = Wᵀ is cut into q×q blocks and **replicated across depth**: rank (k, i, j) holds A_ij, the
  same block on all d layers;
* each layer runs 2D SUMMA (:mod:`.tp2d`) on its own tokens, inside its own q×q grid.

Forward and dX need no communication across depth. The weight gradient does:

    dA_ij = Σ over all token blocks r of X_r,iᵀ dY_r,j
          = Σ_k ( Σ_i' X_(kq+i'),iᵀ dY_(kq+i'),j )       ← SUMMA inside layer k gives the inner sum
                                                             (d partial sums, one per layer)

so each layer's SUMMA gradient is only a partial sum over its 1/d of the tokens, and the d replicas of A_ij
must add theirs: an **all-reduce over the depth group** (the d ranks (·, i, j)). Skip it and
every layer trains on its own tokens only; the replicas drift apart (``tests/test_tp2p5d.py`` shows it).
The same holds for the biases (replicated down the column *and* across depth: sum over both).

Bytes per linear per rank (S_X = |X|/(d·q²), S_A = |A|/q²): SUMMA in the layer 3(q−1)(S_X + S_A), plus the
depth all-reduce 2(d−1)/d · S_A. The activation terms shrink by d against 2D on the same q; the weight
term does not, and the depth all-reduce adds to it. Tesseract's paper states the cost as
3(q−1)(d+1)/(dq) in its units (the comparison table of chapter 07).
"""
from __future__ import annotations

import torch

from .. import comm
from .tp2d import LayerNorm2D, Linear2D, block

__all__ = ["x_block", "block", "Linear2p5D", "LayerNorm2p5D", "bytes_per_linear"]


def x_block(x: torch.Tensor, k: int, i: int, j: int, q: int, d: int) -> torch.Tensor:
    """Rank (k, i, j)'s block of an activation: row block k·q + i of d·q, column block j of q."""
    return x.chunk(d * q, 0)[k * q + i].chunk(q, 1)[j].contiguous()


class Linear2p5D(Linear2D):
    """Linear2D inside one depth layer; weight and bias gradients also summed over depth."""

    def sync_grads(self, depth: bool = True):
        super().sync_grads()                                   # bias: down the column (in this layer)
        if not depth:
            return
        comm.all_reduce(self.weight.grad, group=self.g.group("k"))   # the d replicas of A_ij
        if self.bias is not None and self.bias.grad is not None:
            comm.all_reduce(self.bias.grad, group=self.g.group("k"))


class LayerNorm2p5D(LayerNorm2D):
    def sync_grads(self):
        super().sync_grads()
        for p in (self.weight, self.bias):
            comm.all_reduce(p.grad, group=self.g.group("k"))


def bytes_per_linear(tokens: int, d_in: int, d_out: int, q: int, d: int, value_bytes: int = 4) -> dict:
    """Bytes one rank sends for one :class:`Linear2p5D` (no bias), forward and backward."""
    s_x, s_a = tokens * d_in * value_bytes / (d * q**2), d_in * d_out * value_bytes / q**2
    return {"forward": (q - 1) * (s_x + s_a),
            "backward": 2 * (q - 1) * (s_x + s_a) + (2 * (d - 1) / d * s_a if d > 1 else 0)}

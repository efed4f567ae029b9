"""Measuring one tensor-parallel transformer layer, beside the strategy (:mod:`minipar.tensor.gpt`), which
holds no measuring code: the bytes come from the communication log (:func:`minipar.comm.recording`: the
algorithm's model and what the sockets carried), the activation bytes from the tensors autograd keeps
(:func:`minipar.memory.saved_activation_bytes`), the parameter bytes from the block's own parameters.

The formulas they are checked against are in :mod:`minipar.tensor.sequence` (Shoeybi et al. 2019: 4
all-reduces of b·s·h per layer; Korthikanti et al. 2022: the same bytes as all-gathers + reduce-scatters
under sequence parallelism, and their count of the activations a layer keeps).
"""
from __future__ import annotations

import torch

from .. import comm
from ..memory import saved_activation_bytes
from ..mesh import Mesh
from ..models import Block
from .gpt import TensorParallelBlock
from ..rng import DropoutStreams
from .operators import tp_rank, tp_size

__all__ = ["measure_layer"]


def measure_layer(rank, world_size, cfg, batch_size: int, seq_len: int, sequence_parallel: bool = False,
                  group=None, seed: int = 0, prepare=None) -> dict:
    """One transformer block, forward and backward, on this rank: the bytes it sent (from the comm log: its
    model, ``bytes_sent``; the sockets, ``bytes_observed``; ``calls``; ``by_op``) and the activation bytes
    autograd kept (``activation_bytes``), and the bytes of the parameters the rank's block holds
    (``param_bytes``). ``prepare(block)``, if given, changes the block before it runs (chapter 05's
    variants); run it inside :func:`minipar.comm.ring_algorithms` for minipar's rings."""
    group = group if group is not None else Mesh(world_size, tp=world_size).build(rank).group("tp")
    torch.manual_seed(seed)
    block = TensorParallelBlock(Block(cfg), group, sequence_parallel, DropoutStreams(seed, group))
    if prepare is not None:
        prepare(block)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, seq_len, cfg.n_embd, generator=g)
    if sequence_parallel:
        x = x.chunk(tp_size(group), dim=1)[tp_rank(group)]
    x = x.clone().requires_grad_(True)   # its own storage: a view would count the whole tensor
    with comm.recording() as log:
        y, activations = saved_activation_bytes(block, x, exclude=list(block.parameters()))
        y.backward(torch.ones_like(y))
    return {"bytes_sent": log.bytes_sent, "bytes_observed": log.observed_bytes_sent, "calls": log.count(),
            "by_op": log.by_op(), "activation_bytes": activations,
            "param_bytes": sum(p.numel() * p.element_size() for p in block.parameters())}

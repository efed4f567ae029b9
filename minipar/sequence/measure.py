"""Measure one transformer layer under each context-parallel method, on each rank: bytes per layer (the
communication log's model and what the sockets really carried), activation bytes autograd keeps, and the
attention's compute time (CPU time of the computing thread, so waiting for a neighbour is not counted).
The strategies hold no measuring code: the bytes come from the communication log; the time and the
blocks from a wrapper around the attention core (:func:`measured_core`: a thread-time clock, and the
matrix products counted as they run — every block is two, Q·Kᵀ and P·V), beside :func:`ring_pairs`, what
the ring's schedule says it should compute.

``layer_on_rank(rank, world_size, method, b, s, cfg)`` is a per-rank function for :func:`minipar.launch`;
:func:`formula_bytes` gives each method's closed form for the same quantity (forward + backward).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from .. import comm
from ..memory import saved_activation_bytes
from ..models import TinyGPT
from . import ring_attention, ring_self_attention, ulysses
from .context_parallel import attention_for, attention_layer, local_positions

__all__ = ["layer_on_rank", "formula_bytes", "dense_layer", "ring_pairs", "measured_core"]


def _block_and_input(cfg, b, s, dtype, seed=0):
    block = TinyGPT(cfg.with_(block_size=max(cfg.block_size, s), n_layer=1), seed=seed).blocks[0].to(dtype)
    x = torch.randn(b, s, cfg.n_embd, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    return block, x


def dense_layer(cfg, b: int, s: int, dtype=torch.float32) -> dict:
    """One device: activation bytes of one block on the whole sequence, and its attention compute time."""
    block, x = _block_and_input(cfg, b, s, dtype)
    x.requires_grad_(True)
    _, act = saved_activation_bytes(block, x, exclude=list(block.parameters()) + [x])
    return {"activation_bytes": act}


def ring_pairs(rank: int, world_size: int, zigzag: bool = False) -> int:
    """Chunk pairs (query chunk, key chunk) rank ``rank`` computes in ring attention's forward: over the N
    blocks that pass, every pair :func:`~minipar.sequence.ring_attention.causal_pairs` does not mask out.
    Contiguous: rank + 1 (rank N−1 does N times rank 0's work); zig-zag: 2N + 1 half-size pairs on every
    rank."""
    mine = ring_attention.chunk_ids(rank, world_size, zigzag)
    return sum(len(ring_attention.causal_pairs(mine, ring_attention.chunk_ids(src, world_size, zigzag)))
               for src in range(world_size))


class _CountMatmuls(TorchFunctionMode):
    """Counts the matrix products (``@``, ``torch.matmul``) run while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("matmul", "__matmul__"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def measured_core(attend, calls: list):
    """``attend`` (an attention core q, k, v -> out) that appends, for each forward call, ``(cpu_seconds,
    matmuls)`` to ``calls``: this thread's CPU time (``time.thread_time``: a wait for a neighbour's block does
    not count) and the matrix products it ran (two per block of attention)."""
    def core(q, k, v):
        with _CountMatmuls() as counter:
            t0 = time.thread_time()
            out = attend(q, k, v)
            seconds = time.thread_time() - t0
        calls.append((seconds, counter.count))
        return out
    return core


def layer_on_rank(rank: int, world_size: int, method: str, b: int, s: int, cfg, dtype=torch.float32) -> dict:
    """One block forward and backward on this rank's tokens with ``method``; what it sent and kept."""
    group = dist.new_group(list(range(world_size)))
    block, x = _block_and_input(cfg, b, s, dtype)
    x = x[:, local_positions(s, rank, world_size, method)].clone().requires_grad_(True)
    core_calls: list = []
    attend = measured_core(attention_for(method, group), core_calls)

    def layer(x):
        y = x + attention_layer(block.attn, block.ln1(x), attend)
        return y + block.mlp(block.ln2(y))

    dist.barrier()
    t0 = time.thread_time()
    with comm.recording() as fwd:
        y, act = saved_activation_bytes(layer, x, exclude=list(block.parameters()) + [x])
    forward_cpu = time.thread_time() - t0
    with comm.recording() as bwd:
        y.backward(torch.ones_like(y))
    dist.barrier()
    return {"bytes_sent": fwd.bytes_sent + bwd.bytes_sent,
            "bytes_observed": (None if fwd.observed_bytes_sent is None
                               else fwd.observed_bytes_sent + bwd.observed_bytes_sent),
            "forward_bytes_sent": fwd.bytes_sent, "forward_bytes_observed": fwd.observed_bytes_sent,
            # messages this rank put on the wire: each send, and N−1 per all-to-all (one to each peer)
            "messages": fwd.messages() + bwd.messages(),
            "activation_bytes": act,
            "attention_blocks": sum(m for _, m in core_calls) // 2,        # Q·Kᵀ and P·V per block
            "attention_compute_s": sum(s for s, _ in core_calls), "forward_cpu_s": forward_cpu}


def formula_bytes(method: str, b: int, s: int, h: int, n: int, element_bytes: int = 4) -> float:
    """Bytes one rank sends for one layer, forward + backward, by each method's formula."""
    if method in ("ring", "ring-zigzag"):
        return ring_attention.forward_bytes(b, s, h, n, element_bytes) + \
            ring_attention.backward_bytes(b, s, h, n, element_bytes)
    if method == "ulysses":
        return 2 * ulysses.forward_bytes(b, s, h, n, element_bytes)
    if method == "rsa":
        return ring_self_attention.forward_bytes(b, s, h, n, element_bytes) + \
            ring_self_attention.backward_bytes(b, s, h, n, element_bytes)
    raise ValueError(f"unknown method {method!r}")

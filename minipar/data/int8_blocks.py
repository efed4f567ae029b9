"""Block-wise int8 quantization, the quantizer of ZeRO++'s qwZ and qgZ (:mod:`minipar.data.zeropp`; Wang et al.
2023, arXiv:2306.10209): the one message that carries it (:func:`pack`), and qgZ's direct all-to-all of them.

A flat tensor is cut into blocks of B elements (:meth:`minipar.flat.FlatLayout.in_blocks`: the last one padded
with zeros), and each block gets one FP32 scale::

    s = max|x| / 127        q = round(x / s) ∈ [-127, 127]  (int8)        x ≈ q·s,  |x − q·s| ≤ s/2

Bytes for S elements: S + 4⌈S/B⌉ (:data:`SCALE_BYTES` per block) instead of b·S. (Not FP8: that is
:func:`minipar.precision.fp8.quantize`, a float format with its own scale per tensor or tile.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..flat import FlatLayout

__all__ = ["SCALE_BYTES", "quantize_int8", "dequantize_int8", "round_trip_int8", "pack", "unpack",
           "direct_all_to_all"]

SCALE_BYTES = 4                                  # one FP32 scale per block


def quantize_int8(x: torch.Tensor, block: int) -> tuple:
    """(int8 q, FP32 scales) of flat ``x`` in blocks of ``block`` (the last may be shorter): s = max|x|/127,
    q = round(x/s); a block of zeros has s = 0, q = 0. |x − q·s| ≤ s/2 (up to the dtype's rounding)."""
    layout = FlatLayout.in_blocks([x.shape], block)
    blocks = layout.flatten([x]).view(-1, block)
    scales = (blocks.abs().amax(dim=1) / 127).float()
    s = scales.to(x.dtype)[:, None]
    q = torch.where(s > 0, blocks / s, 0).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(-1)[:layout.numel], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block: int, dtype) -> torch.Tensor:
    """q·s per block, in ``dtype``: the values :func:`quantize_int8` stands for."""
    layout = FlatLayout.in_blocks([q.shape], block)
    blocks = layout.flatten([q]).view(-1, block).to(dtype)
    return (blocks * scales.to(dtype)[:, None]).reshape(-1)[:layout.numel]


def round_trip_int8(x: torch.Tensor, block: int, dtype=None) -> torch.Tensor:
    """What a receiver holds of ``x`` after quantization: dequantize_int8(quantize_int8(x))."""
    return dequantize_int8(*quantize_int8(x, block), block, dtype or x.dtype)


def pack(q, scales) -> torch.Tensor:
    """One uint8 message: the scales' bytes first (so they stay 4-byte aligned), then q's."""
    return torch.cat([scales.view(torch.uint8), q.view(torch.uint8)])


def unpack(message, n: int, block: int, dtype) -> torch.Tensor:
    """The dequantized ``n`` values of one :func:`pack` message."""
    cut = SCALE_BYTES * -(-n // block)
    scales = message[:cut].clone().view(torch.float32)
    return dequantize_int8(message[cut:cut + n].view(torch.int8), scales, block, dtype)


def direct_all_to_all(messages: list, group=None) -> list:
    """``messages[j]`` to the j-th rank of ``group``; returns what each rank sent this one, in source order.
    N−1 sends, one to each peer (the bytes of gloo's all_to_all), so the log holds each message's destination."""
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    received = [m.clone() if j == me else torch.empty_like(messages[me]) for j, m in enumerate(messages)]
    sends = [comm.isend(messages[j].contiguous(), peer) for j, peer in enumerate(ranks) if j != me]
    for j, peer in enumerate(ranks):
        if j != me:
            comm.recv(received[j], peer)
    for work in sends:
        work.wait()
    return received

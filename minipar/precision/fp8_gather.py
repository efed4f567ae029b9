"""ZeRO-3 / FSDP's weight all-gather in FP8: 1 byte per element on the wire instead of BF16's 2 or FP32's 4.

Each rank quantizes its flat shard with its own tensor-wise scale s_r = amax_r / 448 (E4M3), all-gathers the
FP8 bytes and the N scales, and dequantizes piece r with s_r. gloo refuses float8 tensors in collectives, so the
FP8 data moves as a ``uint8`` view of the same bytes — bit for bit. Bytes sent per rank (ring):

    (N - 1)/N · Ψ · b     with b = 4 (FP32), 2 (BF16), 1 (FP8) bytes per element   (+ 4 bytes per scale)

The gathered weights are the ones an FP8 GEMM would use anyway (quantize, then multiply), which is why
torchao's FSDP2 float8 path casts before the all-gather rather than after it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from .formats import E4M3, format_of
from .fp8 import quantize

__all__ = ["fp8_all_gather", "all_gather_bytes"]


def fp8_all_gather(shard: torch.Tensor, group=None, fmt=E4M3) -> torch.Tensor:
    """The full flat tensor gathered from every rank's ``shard`` (same size on every rank) through FP8,
    returned in FP32: piece r = s_r · q_r."""
    fmt = format_of(fmt)
    n = dist.get_world_size(group)
    q = quantize(shard.detach().reshape(1, -1), fmt)
    data = torch.empty(n * shard.numel(), dtype=torch.uint8)
    comm.all_gather_into_tensor(data, q.data.reshape(-1).view(torch.uint8), group)
    scales = torch.empty(n, dtype=torch.float32)
    comm.all_gather_into_tensor(scales, q.scale.reshape(1), group)
    return (data.view(fmt.dtype).float().reshape(n, -1) * scales[:, None]).reshape(-1)


def all_gather_bytes(rank: int, world_size: int, numel: int, dtype: torch.dtype, group=None) -> tuple:
    """Run on every rank: all-gather a ``numel``-element shard in ``dtype`` (float8: through
    :func:`fp8_all_gather`). Returns (bytes the log's model says were sent, bytes observed on the sockets,
    the gathered tensor in FP32, this rank's shard)."""
    shard = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    with comm.recording() as log:
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            full = fp8_all_gather(shard, group, dtype)
        else:
            out = torch.empty(world_size * numel, dtype=dtype)
            full = comm.all_gather_into_tensor(out, shard.to(dtype), group).float()
    return log.bytes_sent, log.observed_bytes_sent, full, shard

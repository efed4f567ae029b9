"""ZeRO-Offload: keep the optimizer's shard (FP32 master copy and Adam's state) in host memory and run the
optimizer step on the CPU (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training",
arXiv:2101.06840; *总结* §8.1).

The optimizer state is the largest term of the model states (K = 12 bytes per parameter for mixed-precision
Adam against 2 + 2 for the 16-bit parameters and gradients), and the optimizer step is element-wise and cheap
in FLOPs, so it can run where memory is plentiful. Per step and rank, the gradient shard goes to the host and
the updated parameter shard comes back: b·Ψ/N bytes each way over PCIe. With ZeRO-2 the device then holds
2Ψ + 2Ψ/N bytes of model states instead of 2Ψ + 14Ψ/N.

Use it as the optimizer factory of :class:`minipar.data.zero.ZeRO`::

    ZeRO(model, offloaded(lambda p: torch.optim.Adam(p, lr=1e-3)), stage=2)

On a machine without an accelerator host and device are the same memory: the code path is the real one,
and the byte counters say what would cross the bus.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..memory import tensor_bytes

__all__ = ["OffloadedOptimizer", "offloaded"]


class OffloadedOptimizer:
    """``optimizer_factory`` run on FP32 host copies of ``device_shards``; ``step()`` moves gradients to the
    host, steps there, and copies the updated shards back into the device shards (cast to their dtype)."""

    def __init__(self, device_shards, optimizer_factory, host="cpu"):
        self.device_shards = list(device_shards)
        self.host_shards = [nn.Parameter(s.detach().to(host, torch.float32, copy=True)) for s in self.device_shards]
        self.inner = optimizer_factory(self.host_shards)
        self.state: dict = {}                   # no optimizer state on the device
        self.bytes_to_host = self.bytes_to_device = 0

    @torch.no_grad()
    def step(self) -> None:
        for dev, host in zip(self.device_shards, self.host_shards):
            host.grad = None if dev.grad is None else dev.grad.to(host.device, host.dtype, copy=True)
            if dev.grad is not None:
                self.bytes_to_host += dev.grad.numel() * dev.grad.element_size()
        self.inner.step()
        for dev, host in zip(self.device_shards, self.host_shards):
            dev.copy_(host)                     # host -> device, cast to the device shard's dtype
            self.bytes_to_device += dev.numel() * dev.element_size()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.host_shards + self.device_shards:
            p.grad = None

    def host_bytes(self) -> int:
        """Bytes of the FP32 master shards and the optimizer's state in host memory."""
        state = [v for s in self.inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        return tensor_bytes(self.host_shards + state)


def offloaded(optimizer_factory, host="cpu"):
    """An optimizer factory for :class:`~minipar.data.zero.ZeRO` that runs ``optimizer_factory`` on the host."""
    def make(device_shards):
        return OffloadedOptimizer(device_shards, optimizer_factory, host)
    return make

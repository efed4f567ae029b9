"""Count the operators a program runs, at PyTorch's dispatch level: what each compute segment of a trace would
launch on a GPU (:mod:`minipar.machine.device` prices them).

Every ATen operator that reaches the dispatcher below autograd (a ``TorchDispatchMode``, the layer
``torch.utils.flop_counter`` counts FLOPs at) is one kernel, except views and metadata (``t``, ``view``,
``expand``, ``detach``, ``empty``...), which move no data. For each: its FLOPs (PyTorch's own formulas,
``torch.utils.flop_counter.flop_registry``: matmuls, convolutions, attention), its bytes (every tensor it
reads and writes, at the dtype this program ran: float32 here where a GPU run would often use 16 bits), and
its kind — "gemm" (mm, addmm, bmm, baddbmm), "attention" (the fused scaled-dot-product kernels) or "memory".

    with OperatorCounter() as counter:
        loss = model(x).sum(); loss.backward()
    counter.take()          # [{"name": "aten.mm", "kind": "gemm", "count": 6, "flops": ..., "bytes": ...}, ...]

Alike operators (same name, FLOPs and bytes) are merged into one row with a count. Counting slows every
operator: time such a run for its operators, not its seconds.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from minipar.machine.device import kernel_count, ops_of, rows_of   # the rows as the device model's Ops
from minipar.memory import tensors_in

__all__ = ["OperatorCounter", "kernel_count", "ops_of", "rows_of"]

aten = torch.ops.aten
_NO_KERNEL = {aten.detach, aten._unsafe_view, aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
              aten.new_empty_strided, aten.lift_fresh, aten._local_scalar_dense, aten.set_, aten.resize_,
              aten.is_same_size, aten.sym_size, aten.sym_stride, aten.sym_numel}
_GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.linear}
_ATTENTION = {getattr(aten, n) for n in ("_scaled_dot_product_flash_attention",
                                         "_scaled_dot_product_flash_attention_backward",
                                         "_scaled_dot_product_efficient_attention",
                                         "_scaled_dot_product_efficient_attention_backward",
                                         "_flash_attention_forward", "_flash_attention_backward")
              if hasattr(aten, n)}


def _tensor_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(tree))   # tree_flatten's tensors, read faster


class OperatorCounter(TorchDispatchMode):
    """A dispatch mode that records every kernel-launching operator run inside it (see the module)."""

    def __init__(self):
        super().__init__()
        self._rows: dict = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False    # never compiled; torch's dynamo-disabling wrapper slows every Python frame inside (memory.py)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.namespace != "aten" or packet in _NO_KERNEL or func.is_view:
            return out
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        moved = _tensor_bytes(args) + _tensor_bytes(list(kwargs.values())) + _tensor_bytes(out)
        kind = "gemm" if packet in _GEMMS else "attention" if packet in _ATTENTION else "memory"
        key = (f"aten.{packet.__name__}", kind, int(flops), int(moved))
        self._rows[key] = self._rows.get(key, 0) + 1
        return out

    def take(self) -> list:
        """The operators counted since the last ``take`` (rows of name, kind, count, flops, bytes per
        operator), and start again."""
        rows = [{"name": name, "kind": kind, "count": n, "flops": flops, "bytes": moved}
                for (name, kind, flops, moved), n in self._rows.items()]
        self._rows = {}
        return rows

    def total_flops(self) -> int:
        """FLOPs counted since the last ``take``."""
        return sum(flops * n for (_, _, flops, _), n in self._rows.items())

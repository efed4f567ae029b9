"""PyTorch's own ring attention, beside minipar's: the comparison for chapter 06b.

``torch.distributed.tensor.experimental.context_parallel`` (PyTorch ≥ 2.5) shards buffers along the sequence
and, inside its context, reroutes ``scaled_dot_product_attention`` to a ring. The reroute is registered for
the CUDA attention kernels only (flash, memory-efficient, cuDNN): on CPU, SDPA runs
``aten._scaled_dot_product_flash_attention_for_cpu``, and the public API stops with "does not have a sharding
strategy registered" (:func:`public_context_parallel` returns that message).

Underneath, the ring itself is a template over any kernel that returns ``(out, logsumexp)``:
``_templated_ring_attention`` (private: its name and signature may change between releases). Given the CPU
flash kernel it runs on gloo, forward only, and :func:`torch_ring_attention` calls it that way. Its
load-balanced layout ("round-robin", on by default) is the same zig-zag as minipar's: rank r holds chunks r
and 2N−1−r. Its default rotation is an all-gather of every rank's K,V at once, not a ring of sends.
"""
from __future__ import annotations

import torch

__all__ = ["torch_ring_attention", "public_context_parallel"]


def torch_ring_attention(q, k, v, group, zigzag: bool = False):
    """PyTorch's ring attention forward (causal) on this rank's (b, heads, s/N, d) shards (float32/64)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
        template, options = _attention._templated_ring_attention, _attention._cp_options
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"this PyTorch ({torch.__version__}) has no _templated_ring_attention: {exc}") from None
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    before = options.enable_load_balance
    options.enable_load_balance = zigzag
    try:
        out, _lse, *_ = template(group, 2, kernel, q, k, v, is_causal=True)
    finally:
        options.enable_load_balance = before
    return out


def public_context_parallel(rank: int, world_size: int) -> str:
    """Try the public API on CPU ranks; return "ran" or the first line of the error (per-rank function)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world_size,))
    q, k, v = (torch.randn(1, 2, 16, 4) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return "ran"
    except Exception as exc:  # noqa: BLE001 — the message is the result
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

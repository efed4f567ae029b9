"""Recomputation (activation checkpointing): keep less for the backward pass and compute it again there.

Per transformer block, with s = sequence length, b = micro-batch, h = hidden size, a = heads, 16-bit
activations and 1-byte dropout masks, the backward pass needs (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", §4):

    none        sbh·(34 + 5as/h) bytes    = 34·sbh + 5·as²b  (the as²b terms: softmax out, its dropout mask
                                                              and dropout out, each a×s×s per sample)
    selective   34·sbh bytes              (recompute only the attention core softmax(QKᵀ)V: the s² terms go,
                                           for a few percent more FLOPs)
    full        2·sbh bytes               (keep only the block's input; rerun the whole block forward in the
                                           backward pass: one extra forward, ≈ 1/3 more FLOPs; Chen et al.
                                           2016, "Training Deep Nets with Sublinear Memory Cost")

With β bytes per activation value instead of 2 the same counts are sbh·(16β + 2) + as²b·(2β + 1) for none,
sbh·(16β + 2) for selective and β·sbh for full (:func:`minipar.activations.activation_bytes_formula`, which
also counts them under tensor and sequence parallelism).

Built on ``torch.utils.checkpoint`` (non-reentrant), not by hand, because it already does the three things a
hand-written ``autograd.Function`` gets subtly wrong: it replays the RNG state so dropout draws the same mask
again (the gradients are bit-exact), it works when the inputs do not require grad and with hooks used by
DDP and ZeRO, and it frees what it recomputes as soon as the backward of the region is done. What it does is
simple: run the region under a saved-tensors hook that stores nothing, and in backward rerun the region to
produce the tensors autograd asks for. :func:`apply_recompute` only chooses *where*.
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from .activations import MODES
from .memory import LiveTensorTracker
from .models import TinyGPT
from .tensor.layers import recompute_context_fn     # TP dropout: the recomputation draws the forward's masks

__all__ = ["MODES", "apply_recompute", "remove_recompute", "full_block_forward", "selective_attention",
           "recompute_modes"]


def full_block_forward(block, x):
    """Full recomputation: the whole block runs under checkpoint, so only its input x is kept for the
    backward and every activation inside is recomputed (one extra forward of the block)."""
    return checkpoint(type(block).forward, block, x, use_reentrant=False, context_fn=recompute_context_fn(block))


def selective_attention(attn, q, k, v):
    """Selective recomputation (Korthikanti et al. 2022): only softmax(QKᵀ)·V runs under checkpoint — the
    5as²b term of the activations, the part that is large to keep and cheap to recompute."""
    return checkpoint(type(attn).attention, attn, q, k, v, use_reentrant=False, context_fn=recompute_context_fn(attn))


def apply_recompute(model: nn.Module, mode="full") -> nn.Module:
    """Checkpoint every block of a TinyGPT-shaped model (``model.blocks``, each with ``attn.attention``).

    ``mode`` is one of :data:`MODES` or a list with one mode per block (what a memory budget chooses). The
    parameters and their names are untouched (the checkpointed forward is set on the block instance), so
    the model still compares name by name with the reference. Returns the model.
    """
    modes = [mode] * len(model.blocks) if isinstance(mode, str) else list(mode)
    if len(modes) != len(model.blocks) or any(m not in MODES for m in modes):
        raise ValueError(f"mode must be one of {MODES} or a list of them, one per block "
                         f"({len(model.blocks)} blocks); got {mode!r}")
    remove_recompute(model)
    for block, m in zip(model.blocks, modes):
        if m == "full":
            block.forward = types.MethodType(full_block_forward, block)
        elif m == "selective":
            block.attn.attention = types.MethodType(selective_attention, block.attn)
    model.recompute_modes = modes
    return model


def remove_recompute(model: nn.Module) -> nn.Module:
    for block in model.blocks:
        block.__dict__.pop("forward", None)
        block.attn.__dict__.pop("attention", None)
    model.recompute_modes = ["none"] * len(model.blocks)
    return model


def recompute_modes(model: nn.Module) -> list:
    return list(getattr(model, "recompute_modes", ["none"] * len(model.blocks)))


# ----------------------------------------------------------------------------------------------------
# Measuring it: bytes kept per block, FLOPs of a step, live memory through a step
# ----------------------------------------------------------------------------------------------------

def _block_stack(cfg, mode, dtype, seed):
    model = apply_recompute(TinyGPT(cfg, seed=seed), mode).to(dtype)
    model.train()
    return model


def activation_bytes_per_block(cfg, mode: str, batch: int, seq: int, dtype=torch.float32, seed: int = 0) -> int:
    """Measured bytes one block keeps alive for backward after its forward, in ``mode``.

    Live tensors (:class:`minipar.memory.LiveTensorTracker`) after the forward of 3 blocks minus after 2:
    the difference is one block's share, its input included (the previous block's output, held by its
    LayerNorm or by the checkpoint). Needs ``cfg.n_layer >= 3``."""
    if cfg.n_layer < 3:
        raise ValueError("activation_bytes_per_block needs a config with n_layer >= 3")
    model = _block_stack(cfg, mode, dtype, seed)
    held = []
    for n_blocks in (2, 3):
        torch.manual_seed(seed)
        x0 = torch.randn(batch, seq, cfg.n_embd, dtype=dtype, requires_grad=True)
        tracker = LiveTensorTracker()
        with tracker:
            x = x0
            for block in model.blocks[:n_blocks]:
                x = block(x)
        held.append(tracker.current)      # includes the last output in both cases: it cancels
        del x
    return held[1] - held[0]


def step_flops(model: nn.Module, inputs, targets) -> int:
    """FLOPs of forward + backward (matmuls, counted by ``torch.utils.flop_counter.FlopCounterMode``)."""
    counter = FlopCounterMode(display=False)
    with counter:
        model.loss(inputs, targets).backward()
    return counter.get_total_flops()


def memory_timeline(model: nn.Module, inputs, targets) -> tuple:
    """Live bytes after every operator of one forward + backward: (timeline [(event, bytes, op)], peak,
    index of the first backward event). Parameters and gradients created before are not counted."""
    tracker = LiveTensorTracker(keep_timeline=True)
    with tracker:
        loss = model.loss(inputs, targets)
        backward_starts = len(tracker.timeline)
        loss.backward()
        del loss
    # a copy: the tracker's finalizers keep appending frees when these tensors die later
    return list(tracker.timeline), tracker.peak, backward_starts

"""A transformer layer at real size, written down as the operators a framework runs: the compute half of the
planner's time, priced on a declared GPU by :func:`minipar.machine.device.ops_seconds` (a model).

One layer's forward on one tensor-parallel rank (T = b·s tokens, t the tp degree, e bytes per value; with
sequence parallelism the norms, dropouts and residual adds see T/t tokens)::

    norm · QKV matmul · attention core · output matmul · dropout + residual · norm · MLP matmuls and their
    activation · dropout + residual

Each matmul [M, K] × [K, N] is 2·M·K·N FLOPs and e·(MK + KN + MN) bytes; the attention core is the two
batched matmuls QKᵀ and PV (2·T·s·h/t FLOPs each) with, in Megatron's 2022 kernels, the a/t·s² scores
written to HBM, softmaxed and dropped out (Korthikanti et al. 2022, §4), or one fused FlashAttention kernel
that never writes them (Dao 2023; causal: half the FLOPs). Every other operator is memory-bound: its bytes
are what it reads and writes. The backward of a matmul is two matmuls of the same size (dX and dW), of
FlashAttention 2.5× its forward FLOPs (it recomputes P; Dao 2023, Algorithm 2), of a memory-bound operator
about twice its bytes and kernels (it reads the gradient and what it saved, and writes a gradient).

Recomputation repeats forward operators before the backward: "full" the whole layer; "selective" what the
framework calls so — Megatron the attention core (Korthikanti et al. 2022, §5), torchtitan's op-level policy
every other matmul and the memory-bound operators (FlashAttention's output is kept): :class:`Kernels`.
"""
from __future__ import annotations

from dataclasses import dataclass

from minipar.machine.device import DeviceCard, Op, ops_seconds

from .model import stage_layers

__all__ = ["Kernels", "MEGATRON_2022", "LLAMA3_2024", "TORCHTITAN_EAGER", "layer_forward", "layer_backward",
           "layer_step", "head_step", "optimizer_step", "stage_seconds"]


@dataclass(frozen=True)
class Kernels:
    """How a framework runs a layer. ``norm``: "fused-layernorm" (one kernel, e bytes in and out) or
    "eager-rmsnorm" (PyTorch ops in FP32: about 6 kernels, 32 bytes per element); ``attention``:
    "fused-softmax" (scores in HBM) or "flash"; ``mlp``: "bias-gelu" (f = 4h style, fused) or "swiglu" (three
    matmuls, SiLU and a product eager); ``rope``: rotary embeddings applied eagerly to q and k; ``dropout``;
    ``selective``: "attention-core" or "every-other-matmul"; ``loss_bytes``: bytes per logit of the FP32
    cross-entropy, forward and backward."""
    name: str
    norm: str
    attention: str
    mlp: str
    rope: bool
    dropout: bool
    selective: str
    loss_bytes: float = 24.0


MEGATRON_2022 = Kernels("Megatron-LM 2022", "fused-layernorm", "fused-softmax", "bias-gelu", rope=False,
                        dropout=True, selective="attention-core")
LLAMA3_2024 = Kernels("Llama 3 pretraining (fused)", "fused-layernorm", "flash", "swiglu", rope=True, dropout=False,
                      selective="attention-core")
TORCHTITAN_EAGER = Kernels("torchtitan eager", "eager-rmsnorm", "flash", "swiglu", rope=True, dropout=False,
                           selective="every-other-matmul", loss_bytes=30.0)


def _matmul(name, m, k, n, e, count=1) -> Op:
    return Op(name, "gemm", 2.0 * m * k * n, e * (m * k + k * n + m * n), 1, count,
              (1, round(m), round(k), round(n)))


def _norm(name, elements, kernels: Kernels, e) -> Op:
    if kernels.norm == "eager-rmsnorm":
        return Op(name, "memory", 0.0, 32.0 * elements, 6)
    return Op(name, "memory", 0.0, 2.0 * e * elements, 1)


def layer_forward(model, b: int, t: int = 1, sp: bool = False, kernels: Kernels = MEGATRON_2022, e: int = 2,
                  seq_len: int | None = None) -> list:
    """The forward operators of one layer on one of ``t`` tensor-parallel ranks, micro-batch ``b``, in order."""
    s, keys = seq_len or model.seq_len, model.seq_len      # a context-parallel rank: s/cp queries, all keys
    h, a, f = model.hidden, model.heads, model.ffn
    kv = getattr(model, "kv_heads", None) or a
    T, Tn = b * s, b * s / (t if sp else 1)               # tokens; tokens the norms and residuals see
    qkv = h * (1 + 2 * kv / a) / t
    ops = [_norm("norm 1", Tn * h, kernels, e), _matmul("qkv", T, h, qkv, e)]
    if kernels.rope:
        ops.append(Op("rope q, k", "memory", 0.0, 20.0 * T * h * (1 + kv / a) / t, 8))
    heads_s2 = b * (a / t) * s * keys                     # score entries on this rank
    if kernels.attention == "flash":
        ops.append(Op("flash attention", "attention", 2.0 * T * keys * h / t, e * 4 * T * h / t, 1))  # causal: ½
    else:
        bmm = (round(b * a / t), s, h // a, keys)                  # per head: [s, d] × [d, keys]
        ops += [Op("scores QKᵀ", "gemm", 2.0 * T * keys * h / t, e * (2 * T * h / t + heads_s2), 1, 1, bmm),
                Op("scale-mask-softmax", "memory", 0.0, 2.0 * e * heads_s2, 1)]
        if kernels.dropout:
            ops.append(Op("attention dropout", "memory", 0.0, (2.0 * e + 1) * heads_s2, 1))
        ops.append(Op("attention PV", "gemm", 2.0 * T * keys * h / t, e * (heads_s2 + 2 * T * h / t), 1, 1,
                      (bmm[0], s, keys, h // a)))
    ops.append(_matmul("out proj", T, h / t, h, e))
    residual = (3.0 * e + (1 if kernels.dropout else 0)) * Tn * h
    ops += [Op("dropout + residual 1", "memory", 0.0, residual, 1), _norm("norm 2", Tn * h, kernels, e)]
    if kernels.mlp == "swiglu":
        ops += [_matmul("w1", T, h, f / t, e), _matmul("w3", T, h, f / t, e),
                Op("silu · w3x", "memory", 0.0, 5.0 * e * T * f / t, 2), _matmul("w2", T, f / t, h, e)]
    else:
        ops += [_matmul("fc1", T, h, f / t, e), Op("bias-gelu", "memory", 0.0, 2.0 * e * T * f / t, 1),
                _matmul("fc2", T, f / t, h, e)]
    ops.append(Op("dropout + residual 2", "memory", 0.0, residual, 1))
    return ops


def _backward(op: Op) -> list:
    if op.kind == "gemm":             # [M,K]·[K,N]: dX = dY·Wᵀ is [M,N]·[N,K], dW = Xᵀ·dY is [K,M]·[M,N]
        batch, m, k, n = op.shape or (1, 1, 1, 1)
        return [Op(op.name + " dX", "gemm", op.flops, op.bytes, 1, 1, (batch, m, n, k) if op.shape else ()),
                Op(op.name + " dW", "gemm", op.flops, op.bytes, 1, 1, (batch, k, m, n) if op.shape else ())]
    if op.kind == "attention":
        return [Op(op.name + " backward", "attention", 2.5 * op.flops, 2 * op.bytes, 2)]
    return [Op(op.name + " backward", "memory", 0.0, 2 * op.bytes, 2 * op.kernels)]


def _recomputed(forward: list, recompute: str, kernels: Kernels) -> list:
    if recompute == "full":
        return list(forward)
    if recompute != "selective":
        return []
    if kernels.selective == "attention-core":
        core = ("scores QKᵀ", "scale-mask-softmax", "attention dropout", "attention PV", "flash attention")
        return [op for op in forward if op.name in core]
    matmuls = [op for op in forward if op.kind == "gemm"]
    return [op for op in forward if op.kind == "memory"] + matmuls[1::2]      # every other matmul


def layer_backward(forward: list, recompute: str = "none", kernels: Kernels = MEGATRON_2022) -> list:
    """What ``recompute`` repeats of a layer's ``forward`` operators, then their backward, last operator first."""
    return _recomputed(forward, recompute, kernels) + [x for op in reversed(forward) for x in _backward(op)]


def layer_step(model, b, t=1, sp=False, recompute="none", kernels=MEGATRON_2022, e=2, seq_len=None) -> list:
    """One layer's forward, what ``recompute`` repeats, and its backward, for one micro-batch."""
    forward = layer_forward(model, b, t, sp, kernels, e, seq_len)
    return forward + layer_backward(forward, recompute, kernels)


def head_step(model, b, t=1, kernels=MEGATRON_2022, e=2, seq_len=None) -> list:
    """The last stage's final norm, output matmul (vocabulary split over t) and FP32 cross-entropy, forward
    and backward, for one micro-batch of ``seq_len`` tokens a row (a context-parallel rank's s/cp: each cp
    rank computes the logits and the loss of its own tokens only)."""
    T, h = b * (seq_len or model.seq_len), model.hidden
    forward = [_norm("final norm", T * h, kernels, e), _matmul("output", T, h, model.vocab / t, e)]
    loss = Op("cross-entropy (fp32)", "memory", 0.0, kernels.loss_bytes * T * model.vocab / t, 6)
    return forward + [loss] + [x for op in forward for x in _backward(op)]


def optimizer_step(parameters: float, bytes_per_parameter: float = 30.0, kernels: int = 12) -> list:
    """Adam on ``parameters`` (mixed precision: read FP32 weight, m, v and gradient, write weight, m, v and
    the 16-bit copy, 4·4 + 3·4 + 2 = 30 bytes each) in ``kernels`` multi-tensor kernels."""
    return [Op("adam", "memory", 0.0, bytes_per_parameter * parameters, kernels)]


def stage_seconds(model, layout, card: DeviceCard, kernels: Kernels = MEGATRON_2022, e: int = 2) -> dict:
    """Seconds of one micro-batch's forward + backward on a stage: {"layer": one layer, "first": the first
    stage, "last": the last stage (with the head), "slowest": the largest of these and a middle stage
    (:func:`.model.stage_layers`: a balanced cut's middle stages hold one layer more), "gemm" and "attention":
    the fullest stage's layers' matmuls and attention core (what async TP and CP's ring hide their transfers
    under)}."""
    first_layers, layers, last_layers = stage_layers(model.layers, layout.pp, layout.v)
    ops = layer_step(model, layout.micro_batch, layout.tp, layout.sp, layout.recompute, kernels, e,
                     model.seq_len // layout.cp)
    layer = ops_seconds(ops, card)
    core = [op for op in ops if op.kind == "attention" or op.name.startswith(("scores", "scale-mask", "attention"))]
    local = model.seq_len // layout.cp                     # the tokens this cp rank embeds and scores
    embedding = ops_seconds([Op("embedding", "memory", 0.0, 3.0 * e * layout.micro_batch * local
                                * model.hidden, 3)], card)
    head = ops_seconds(head_step(model, layout.micro_batch, layout.tp, kernels, e, local), card)
    first = first_layers * layer + embedding + (head if layout.pp == 1 else 0.0)
    last = last_layers * layer + head + (embedding if layout.pp == 1 else 0.0)
    return {"layer": layer, "first": first, "last": last, "slowest": max(first, last, layers * layer),
            "gemm": layers * ops_seconds([op for op in ops if op.kind == "gemm" and op not in core], card),
            "attention": layers * ops_seconds(core, card)}

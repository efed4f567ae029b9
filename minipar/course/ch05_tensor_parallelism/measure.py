"""Chapter 05's runs, one rank's side of each (§2, §4, §5 and §10: a TP module against one device or PyTorch's
own TP API), and its memory per rank, from live tensors: one transformer layer split t ways, its parameters
(what the rank's modules hold) and the activations autograd keeps for backward, both measured by
:func:`minipar.tensor.measure.measure_layer`, beside the formulas.

Formulas (per layer, float32 here; h hidden, a heads, s sequence, b batch):

* parameters ``(12h² + 7h)/t + 6h`` values: the QKV, projection, fc and proj weights and the column-parallel
  biases are split; the two LayerNorms (4h) and the two row-parallel biases (2h) are whole on every rank;
* activations: Korthikanti et al.'s count (:func:`minipar.activations.activation_bytes_formula`, 4-byte
  values, no dropout) plus what PyTorch keeps that it leaves out
  (:func:`minipar.tensor.sequence.uncounted_bytes`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minipar.launcher import launch
from minipar.mesh import Mesh
from minipar.tensor import layers, vocab

__all__ = ["memory_per_degree", "param_values_formula", "layer_bytes", "mlp_vs_one_device",
           "attention_vs_one_device", "loss_vs_one_device", "mine_vs_pytorch"]


def param_values_formula(h: int, t: int) -> float:
    """Parameters one rank holds for one layer: the split matrices and column biases /t, the rest whole."""
    return (12 * h * h + 7 * h) / t + 6 * h


def memory_per_degree(degrees=(1, 2, 4), b: int = 4, s: int = 16, h: int = 32, a: int = 4) -> list:
    """[{"t", "param_bytes", "param_formula", "activation_bytes", "activation_formula"}], one launch per
    degree; measured values are the maximum over the ranks (all equal here)."""
    from minipar.models import GPTConfig
    from minipar.tensor.measure import measure_layer
    from minipar.activations import activation_bytes_formula
    from minipar.tensor.sequence import uncounted_bytes

    rows = []
    for t in degrees:
        per_rank = launch(measure_layer, t, GPTConfig(n_embd=h, n_head=a), b, s, quiet=True)
        rows.append({"t": t,
                     "param_bytes": max(r["param_bytes"] for r in per_rank),
                     "param_formula": 4 * param_values_formula(h, t),
                     "activation_bytes": max(r["activation_bytes"] for r in per_rank),
                     "activation_formula": activation_bytes_formula(s, b, h, a, t=t, value_bytes=4, dropout=False)
                     + uncounted_bytes(s, b, t)})
    return rows


def layer_bytes(degrees=(2, 4), b: int = 4, s: int = 16, h: int = 32, a: int = 4) -> dict:
    """{t: (rank 0's communication log of one layer's forward and backward {"bytes_sent", "by_op"}, the bytes
    each rank wrote to its sockets for it (mean over ranks), the formula 4 · 2(t-1)/t · b·s·h·4)}."""
    from minipar.course.tp_layer import measure_layer_on_wire
    from minipar.models import GPTConfig
    from minipar.tensor.measure import measure_layer
    from minipar.tensor.sequence import tp_bytes_per_layer

    out = {}
    for t in degrees:
        sent = launch(measure_layer, t, GPTConfig(n_embd=h, n_head=a), b, s, False, quiet=True)[0]
        wire = launch(measure_layer_on_wire, t, GPTConfig(n_embd=h, n_head=a), False, False, b, s, quiet=True)
        out[t] = (sent, sum(r[1] for r in wire) / t, tp_bytes_per_layer(s, b, h, t))
    return out


def mlp_vs_one_device(rank, world_size):
    """§2: the tensor-parallel MLP (column-parallel fc, row-parallel proj) against one device's: shard shapes,
    max |y − y_ref|, max |dX − dX_ref| and the forward's and backward's collectives."""
    from minipar import comm
    from minipar.models import GPTConfig, FeedForward
    group = Mesh(world_size, tp=world_size).build(rank).group("tp")   # the TP group is an argument
    torch.manual_seed(0)
    ref = FeedForward(GPTConfig(n_embd=32))
    tp_mlp = layers.TensorParallelMLP(ref.fc, ref.proj, group)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    x_ref, x_tp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with comm.recording() as fwd:
        y = tp_mlp(x_tp)
    with comm.recording() as bwd:
        y.pow(2).sum().backward()
    ref(x_ref).pow(2).sum().backward()
    return {"shard of A": tuple(tp_mlp.fc.weight.T.shape), "shard of B": tuple(tp_mlp.proj.weight.T.shape),
            "max |y - y_ref|": float((y - ref(x)).abs().max()),
            "max |dX - dX_ref|": float((x_tp.grad - x_ref.grad).abs().max()),
            "forward": fwd.by_op(), "backward": bwd.by_op()}


def attention_vs_one_device(rank, world_size):
    """§4: attention split by heads against one device's: (local heads, QKV shard shape, max |y − y_ref|)."""
    from minipar.models import GPTConfig, CausalSelfAttention
    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    torch.manual_seed(0)
    ref = CausalSelfAttention(GPTConfig(n_embd=32, n_head=8))
    tp_attn = layers.TensorParallelAttention(ref, group)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    return tp_attn.local_heads, tuple(tp_attn.qkv.weight.shape), float((tp_attn(x) - ref(x)).abs().max())


def loss_vs_one_device(rank, world_size, vocab_size, eps):
    """§5: the vocabulary-parallel cross-entropy (label smoothing ``eps``) and embedding against PyTorch's:
    (loss, reference loss, all-reduces, bytes sent, max embedding gap)."""
    from minipar import comm
    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 8, vocab_size, generator=g, dtype=torch.float64)
    targets = torch.randint(vocab_size, (4, 8), generator=g)
    want = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), label_smoothing=eps)
    padded = vocab.padded_vocab_size(vocab_size, world_size)
    logits = torch.cat([logits, torch.zeros(4, 8, padded - vocab_size, dtype=torch.float64)], -1)
    with comm.recording() as log:
        got = vocab.vocab_parallel_cross_entropy(logits.chunk(world_size, -1)[rank], targets, group, vocab_size,
                                                 eps).mean()
    emb = torch.nn.Embedding.from_pretrained(torch.randn(vocab_size, 8, generator=g, dtype=torch.float64))
    embedding_gap = (vocab.VocabParallelEmbedding(emb, group)(targets) - emb(targets)).abs().max()   # the lookup, split
    return float(got), float(want), log.count("all_reduce"), log.bytes_sent, float(embedding_gap)


def mine_vs_pytorch(rank, world_size):
    """§10: minipar's TP MLP against PyTorch's ``parallelize_module`` (ColwiseParallel, RowwiseParallel) on the
    same weights: (max |y_mine − y_theirs|, max |dW_mine − dW_theirs|, the type of PyTorch's weight)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from minipar.models import MLP
    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    ref, theirs = MLP((32, 128, 32), seed=0), MLP((32, 128, 32), seed=0)
    mine = layers.TensorParallelMLP(ref.layers[0], ref.layers[1], group)
    parallelize_module(theirs, DeviceMesh.from_group(group, "cpu"),
                       {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))
    y_mine, y_theirs = mine(x), theirs(x)
    y_mine.sum().backward(); y_theirs.sum().backward()
    return (float((y_mine - y_theirs).abs().max()),
            float((mine.fc.weight.grad - theirs.layers[0].weight.grad.to_local()).abs().max()),
            type(theirs.layers[0].weight).__name__)

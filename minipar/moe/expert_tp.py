"""Expert tensor parallelism (expert-TP > 1): every expert's FFN split over tp ranks, beside expert parallelism.

World = dp × ep × tp (``Mesh(world, dp=.., ep=.., tp=..)``, tp innermost). Non-expert parameters are replicated and
data-parallel over all W ranks, as in :mod:`minipar.moe.expert_parallel`; EP rank e holds experts e·E/ep … of every
MoE layer, and within its tp group of t ranks each rank holds **1/t of every one of them**: Megatron's split of an
FFN (Shoeybi et al. 2019, arXiv:1909.08053) — fc's rows (column-parallel, with its bias), proj's columns
(row-parallel); proj's bias is added once, after the sum. Per MoE layer, on a rank with T tokens:

1. route, fill the padded buffer (E, C, M) and all-to-all over the EP group (chapter 09), as
   :class:`~minipar.moe.expert_parallel.ExpertParallelMoE` does: each local expert receives ep·C slots;
2. **all-gather over tp** the slots (each tp rank received other tokens for the same experts), so every tp rank
   runs its 1/t of each expert on the t·ep·C slots (backward: reduce-scatter of their gradients);
3. **reduce-scatter over tp** the partial outputs: Σ over the t hidden-unit shards, each rank keeping its own
   ep·C slots (backward: all-gather); add proj's bias; all-to-all back and combine.

The tp exchanges move, per layer per micro-batch and direction, (t−1)·E/ep·ep·C·M·b bytes per rank (an
all-gather's and a reduce-scatter's ring share of t·ep·C·M·b per local expert), the price of holding 1/t of each
expert's weights (Megatron-Core's MoE "parallel folding" with ETP > 1). Gradients, ÷ W: dense over every rank; an
expert shard over its replicas (dp: it already sums every token of its dp slice, which the tp all-gather and the
EP all-to-all brought it); proj's bias over dp × tp (each tp rank added it to its own slots).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..launcher import launch
from ..loop import shard_batch
from ..mesh import Mesh
from ..recipe import RunResult
from ..tensor.operators import gather_sequence, scatter_sequence
from ..validation import positive_int
from . import expert_parallel as epm

__all__ = ["ExpertShard", "ExpertTPMoE", "validate", "build", "sync_gradients", "full_params", "parallel_train",
           "run"]


class ExpertShard(nn.Module):
    """Hidden units r·H/t … (r+1)·H/t of an expert FFN: fc's rows and bias, proj's columns. Its output is a partial
    sum; the FFN = Σ over the t shards + ``proj_bias`` (held here, added by the caller after the sum)."""

    def __init__(self, ffn, tp_rank: int, tp: int):
        super().__init__()
        h = ffn.fc.out_features // tp
        rows = slice(tp_rank * h, (tp_rank + 1) * h)
        like = dict(dtype=ffn.fc.weight.dtype, device=ffn.fc.weight.device)
        self.fc = nn.Linear(ffn.fc.in_features, h, bias=ffn.fc.bias is not None, **like)
        self.proj = nn.Linear(h, ffn.proj.out_features, bias=False, **like)
        with torch.no_grad():
            self.fc.weight.copy_(ffn.fc.weight[rows])
            self.proj.weight.copy_(ffn.proj.weight[:, rows])
            if ffn.fc.bias is not None:
                self.fc.bias.copy_(ffn.fc.bias[rows])
        self.proj_bias = None if ffn.proj.bias is None else nn.Parameter(ffn.proj.bias.detach().clone())

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class ExpertTPMoE(epm.ExpertParallelMoE):
    """An expert-parallel MoE layer whose local experts are :class:`ExpertShard` s over ``tp_group``."""

    def __init__(self, layer, ep_rank: int, ep: int, ep_group, token_group, tp_rank: int, tp: int, tp_group):
        super().__init__(layer, ep_rank, ep, ep_group, token_group)
        self.experts = nn.ModuleList(ExpertShard(e, tp_rank, tp) for e in self.experts)
        self.tp_group = tp_group

    def run_experts(self, buffer):
        e, c, m = buffer.shape
        ep, per = e // self.per_rank, self.per_rank
        received = epm.all_to_all(buffer, self.ep_group).view(ep, per, c, m).transpose(0, 1)
        slots = received.reshape(per, ep * c, m)                     # each local expert's ep·C slots
        gathered = gather_sequence(slots, self.tp_group)             # (per, t·ep·C, M): every tp rank's slots
        partial = torch.stack([shard(gathered[j]) for j, shard in enumerate(self.experts)])
        out = scatter_sequence(partial, self.tp_group)               # Σ over the shards, my slots
        if self.experts[0].proj_bias is not None:
            out = out + torch.stack([s.proj_bias for s in self.experts]).unsqueeze(1)
        out = out.view(per, ep, c, m).transpose(0, 1).reshape(e, c, m)
        return epm.all_to_all(out, self.ep_group)                    # back to the tokens' ranks


def validate(recipe, *, world_size: int, ep: int, tp: int, micro_batches: int = 1) -> None:
    """:func:`minipar.moe.expert_parallel.validate` for world = dp × ep × tp, and tp dividing every expert's hidden."""
    positive_int("tp", tp)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or world_size % (ep * tp):
        raise ValueError(f"ep × tp = {ep} × {tp} must divide the world size {world_size} (world = dp × ep × tp)")
    epm.validate(recipe, world_size=world_size, ep=ep, micro_batches=micro_batches)
    model = recipe.model()
    hidden = model.moe_layers()[0].experts[0].fc.out_features
    if hidden % tp:
        raise ValueError(f"expert-TP {tp} must divide each expert's {hidden} hidden units")
    if model.moe.bias_rate > 0 or model.moe.shared or model.moe.dropless:
        raise ValueError("expert-TP here runs routed, padded experts: no loss-free bias, shared experts or dropless")


def build(rank: int, world_size: int, recipe, ep: int, tp: int):
    """This rank's model (its shards of its experts), {local name: (reference name, how to rebuild)} and mesh."""
    mesh = Mesh(world_size, dp=world_size // (ep * tp), ep=ep, tp=tp).build(rank)
    model = recipe.model().to(recipe.dtype)
    names = {}
    for b in model.moe_blocks():
        layer = ExpertTPMoE(model.blocks[b].mlp, mesh.coord("ep"), ep, mesh.group("ep"), mesh.group("dp", "ep", "tp"),
                            mesh.coord("tp"), tp, mesh.group("tp"))
        model.blocks[b].mlp = layer
        for j in range(layer.per_rank):
            ref = f"blocks.{b}.mlp.experts.{layer.first + j}"
            local = f"blocks.{b}.mlp.experts.{j}"
            names |= {f"{local}.fc.weight": (f"{ref}.fc.weight", 0), f"{local}.fc.bias": (f"{ref}.fc.bias", 0),
                      f"{local}.proj.weight": (f"{ref}.proj.weight", 1), f"{local}.proj_bias": (f"{ref}.proj.bias", None)}
    for n, _ in model.named_parameters():
        names.setdefault(n, (n, None))
    return model, names, mesh


def sync_gradients(model, names: dict, mesh, world_size: int) -> None:
    """Σ of the gradients over their replicas, ÷ W: shards (split along a dim) over dp, proj's bias over dp × tp,
    the rest over every rank (module docstring)."""
    def group_of(name):
        if not epm.is_expert(name):
            return mesh.group("dp", "ep", "tp")
        return mesh.group("dp") if names[name][1] is not None else mesh.group("dp", "tp")
    by_group = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_group.setdefault(group_of(n), []).append(p.grad)
    for group, grads in by_group.items():
        comm.all_reduce_flat(grads, group=group)
        for g in grads:
            g /= world_size


def full_params(model, names: dict, mesh) -> dict:
    """Every parameter this rank holds under its reference name, the shards all-gathered over tp and joined."""
    tp = mesh.size("tp")
    out = {}
    for n, p in model.named_parameters():
        ref, dim = names[n]
        if dim is None or tp == 1:
            out[ref] = p.detach().clone()
            continue
        pieces = [torch.empty_like(p) for _ in range(tp)]
        comm.all_gather(pieces, p.detach().contiguous(), group=mesh.group("tp"))
        out[ref] = torch.cat(pieces, dim=dim)
    return out


def parallel_train(rank: int, world_size: int, recipe, *, ep: int, tp: int, micro_batches: int = 1,
                   step_log: comm.CommLog | None = None):
    """Train ``recipe`` with EP × expert-TP (× DP = world/(ep·tp)); ``step_log`` records every exchange with the mesh."""
    validate(recipe, world_size=world_size, ep=ep, tp=tp, micro_batches=micro_batches)
    model, names, mesh = build(rank, world_size, recipe, ep, tp)
    opt = recipe.optimizer(model.parameters())
    losses = []
    for batch in recipe.batches:
        inputs, targets = shard_batch(batch, rank, world_size)
        with comm.recording(step_log, mesh=mesh) if step_log is not None else contextlib.nullcontext():
            opt.zero_grad(set_to_none=True)
            local = torch.zeros((), dtype=torch.float64)
            for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
                loss = recipe.loss(model, x, y) / micro_batches
                loss.backward()
                local += loss.detach().double()
            sync_gradients(model, names, mesh, world_size)
            opt.step()
        comm.all_reduce(local)
        losses.append(local.item() / world_size)
    return RunResult(losses, full_params(model, names, mesh))


def run(recipe, *, world_size: int, ep: int, tp: int, micro_batches: int = 1, quiet: bool = True, **kwargs) -> list:
    """Validate, then :func:`parallel_train` on ``world_size`` ranks; the per-rank results."""
    validate(recipe, world_size=world_size, ep=ep, tp=tp, micro_batches=micro_batches)
    return launch(parallel_train, world_size, recipe, quiet=quiet, ep=ep, tp=tp, micro_batches=micro_batches,
                  **kwargs)

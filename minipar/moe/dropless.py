"""Dropless expert parallelism: no capacity, tokens permuted by expert, uneven all-to-alls, a grouped GEMM.

Chapter 09's :mod:`minipar.moe.expert_parallel` pads every expert to C slots and drops what overflows, so that one
all-to-all of equal chunks moves fixed-shape buffers. Current practice (MegaBlocks: Gale et al. 2022,
arXiv:2211.15841; Megatron-Core's and torchtitan's token dispatchers) keeps every token. Per MoE layer, on a rank
with T tokens, top-k, E experts over an EP group of ep ranks (E/ep local experts), width M, b bytes per element:

1. route (``MoEConfig(dropless=True)``: no capacity, every choice kept, the capacity factor unused);
2. **permute**: the k·T token-choices sorted by expert (stable), counts n(e) per expert (:func:`permute`);
3. **exchange the split sizes**: an all-to-all of the E counts (E/ep to each peer), then one read of the counts
   into Python lists to size the buffers — the layer's **one host sync** per forward (``host_syncs``; the
   backward and the combine reuse the sizes, so no other);
4. **variable all-to-all** (dispatch): the rows for EP rank j's experts go to rank j
   (:func:`minipar.comm.all_to_all_single` with split sizes: gloo's list ``all_to_all`` wants equal chunks);
   the rows received, source-major, are regrouped expert-major;
5. the local experts run on their uneven row counts: a **grouped GEMM** (``torch._grouped_mm``, one call for
   every expert: it runs on CPU for float32/bfloat16 with 16-byte-aligned rows), else one matmul per expert
   (float64 and odd widths; :func:`grouped_ffn` says which in ``last_path``);
6. the inverse regrouping and all-to-all (combine), then **unpermute**: y_t = Σ_j gate_tj · out_{t,j}.

Bytes each rank sends per exchange (dispatch or combine, forward or backward), from the log: the rows for the
other ranks' experts, M·b·Σ_{e not local} n(e) (dispatch; combine: M·b·Σ_{peers s} n_s(my experts)). Under
uniform routing n(e) = k·T/E, so each exchange sends **k·T·M·b·(ep−1)/ep** — no cf, no empty slots — and a
layer's training step four times that, plus the counts: E·(ep−1)/ep integers (8 bytes) per forward. Under a
planted imbalance (every token to one expert) the owner of that expert receives k·T·(ep−1) rows per exchange and
sends 0 (its own rows stay); nothing is dropped, where a padded run with cf < E/k would drop.
Gradients, the balance loss and loss-free balancing are :mod:`minipar.moe.expert_parallel`'s (this layer
subclasses its :class:`~minipar.moe.expert_parallel.ExpertParallelMoE`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..launcher import launch
from . import expert_parallel as epm
from .balance import z_loss
from .router import route

__all__ = ["permute", "unpermute", "grouped_ffn", "variable_all_to_all", "DroplessMoE", "validate", "build",
           "parallel_train", "run", "predicted_exchange_bytes"]


def permute(routing):
    """(order, counts): the flat token-choices (t·k + j) sorted by expert, stable; tokens per expert (E,)."""
    expert = routing.expert.reshape(-1)
    return torch.argsort(expert, stable=True), torch.bincount(expert, minlength=routing.experts)


def unpermute(rows, order, routing, tokens: int):
    """y (T, M): each output row (in ``order``) weighted by its gate and added to its token."""
    gate = routing.gate.reshape(-1)[order].unsqueeze(-1)
    token = order // routing.expert.shape[1]
    return rows.new_zeros(tokens, rows.shape[-1]).index_add(0, token, rows * gate)


def _grouped_mm_runs(rows, experts) -> bool:
    """torch's grouped matmul on CPU: float32/bfloat16, every row 16-byte aligned, no dropout to draw per expert."""
    widths = (experts[0].fc.in_features, experts[0].fc.out_features)
    return (hasattr(torch, "_grouped_mm") and rows.dtype in (torch.float32, torch.bfloat16) and rows.shape[0] > 0
            and all(w * rows.element_size() % 16 == 0 for w in widths) and experts[0].drop.p == 0)


def _linear_grouped(x, linears, offsets, counts):
    weight = torch.stack([lin.weight for lin in linears]).transpose(1, 2)          # (E, in, out)
    y = torch._grouped_mm(x, weight, offs=offsets)
    if linears[0].bias is not None:
        y = y + torch.stack([lin.bias for lin in linears]).repeat_interleave(counts, dim=0)
    return y


def grouped_ffn(experts, rows, counts: list, grouped: bool | None = None):
    """Expert e's FFN on its ``counts[e]`` consecutive rows, (Σ counts, M). ``grouped`` None: the grouped GEMM where
    it runs (:func:`_grouped_mm_runs`), else one matmul per expert; returns (out, "grouped" or "per expert")."""
    if grouped is None:
        grouped = _grouped_mm_runs(rows, experts)
    if not grouped:
        return torch.cat([e(chunk) for e, chunk in zip(experts, rows.split(counts))]), "per expert"
    n = torch.tensor(counts, device=rows.device)
    offsets = n.cumsum(0).to(torch.int32)
    hidden = F.gelu(_linear_grouped(rows, [e.fc for e in experts], offsets, n))
    return _linear_grouped(hidden, [e.proj for e in experts], offsets, n), "grouped"


class _VariableAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, log_mesh):
        ctx.splits, ctx.group, ctx.log_mesh = (out_splits, in_splits), group, log_mesh
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        with epm.logged_with(log_mesh):
            return comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):                  # the same exchange reversed: gradients back to the rows' owners
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        with epm.logged_with(ctx.log_mesh):
            comm.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None, None


def variable_all_to_all(x, out_splits: list, in_splits: list, group, log_mesh=None):
    """Differentiable uneven all-to-all: ``in_splits[j]`` rows of ``x`` to rank j, ``out_splits[j]`` from it."""
    return _VariableAllToAll.apply(x, out_splits, in_splits, group, log_mesh)


def _regroup(rows, sizes: list, outer: int, inner: int):
    """Rows in blocks sizes[a·inner + b] (a < outer, b < inner) reordered b-major: blocks (b, a)."""
    blocks = rows.split(sizes)
    return torch.cat([blocks[a * inner + b] for b in range(inner) for a in range(outer)])


class DroplessMoE(epm.ExpertParallelMoE):
    """An expert-parallel MoE layer with no capacity (module docstring). ``host_syncs``: split-size reads so far;
    ``last_path``: "grouped" or "per expert", how the local experts last ran."""

    host_syncs, last_path = 0, None

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        self.routing = route(logits, self.moe.k, cap=flat.shape[0], bias=getattr(self, "routing_bias", None))
        self.aux_loss = self.balance_loss(self.routing)
        if self.moe.z_loss:
            self.aux_loss = self.aux_loss + z_loss(logits, self.moe.z_loss)
        order, counts = permute(self.routing)
        out = self.run_dropless(flat[order // self.moe.k], counts)
        y = unpermute(out, order, self.routing, flat.shape[0])
        for expert in self.shared:
            y = y + expert(flat)
        return y.view(shape)

    def run_dropless(self, rows, counts):
        """Rows sorted by expert (``counts`` per expert, all E) -> their experts' outputs, in the same order."""
        experts = list(self.experts.children())
        if self.ep_group is None:
            self.host_syncs += 1
            out, self.last_path = grouped_ffn(experts, rows, counts.tolist())
            return out
        ep, per, tag = dist.get_world_size(self.ep_group), self.per_rank, self.log_mesh("ep")
        with epm.logged_with(tag):
            received = epm.exchange(counts, self.ep_group)          # [source s][my expert j]: n_s(j)
        sizes = torch.cat([counts, received]).tolist()             # the one host sync of the layer's forward
        self.host_syncs += 1
        mine, theirs = sizes[:ep * per], sizes[ep * per:]
        send = [sum(mine[j * per:(j + 1) * per]) for j in range(ep)]
        got = [sum(theirs[s * per:(s + 1) * per]) for s in range(ep)]
        arrived = variable_all_to_all(rows, got, send, self.ep_group, tag)        # source-major
        by_expert = _regroup(arrived, theirs, ep, per)                             # expert-major
        per_expert = [sum(theirs[s * per + j] for s in range(ep)) for j in range(per)]
        out, self.last_path = grouped_ffn(experts, by_expert, per_expert)
        by_source = _regroup(out, [theirs[s * per + j] for j in range(per) for s in range(ep)], per, ep)
        return variable_all_to_all(by_source, send, got, self.ep_group, tag)       # back to the tokens' ranks


def validate(recipe, *, world_size: int, ep: int, micro_batches: int = 1) -> None:
    """:func:`minipar.moe.expert_parallel.validate`, and the recipe's MoE must be dropless (``moe_recipe(dropless=True)``)."""
    epm.validate(recipe, world_size=world_size, ep=ep, micro_batches=micro_batches)
    if not recipe.model().moe.dropless:
        raise ValueError("dropless expert parallelism needs a dropless MoE (moe_recipe(..., dropless=True)): its "
                         "one-device reference must keep every token too")


def build(rank: int, world_size: int, recipe, ep: int):
    """This rank's model (its experts only, as :class:`DroplessMoE` layers), {local: reference} names, mesh."""
    return epm.build(rank, world_size, recipe, ep, layer=DroplessMoE)


def parallel_train(rank: int, world_size: int, recipe, *, ep: int, micro_batches: int = 1,
                   step_log: comm.CommLog | None = None, routings: list | None = None):
    """:func:`minipar.moe.expert_parallel.parallel_train` with dropless layers (its ``step_log``, ``routings``)."""
    validate(recipe, world_size=world_size, ep=ep, micro_batches=micro_batches)
    return epm.parallel_train(rank, world_size, recipe, ep=ep, micro_batches=micro_batches, step_log=step_log,
                              routings=routings, layer=DroplessMoE)


def run(recipe, *, world_size: int, ep: int, micro_batches: int = 1, quiet: bool = True, **kwargs) -> list:
    """Validate, then :func:`parallel_train` on ``world_size`` ranks; the per-rank results."""
    validate(recipe, world_size=world_size, ep=ep, micro_batches=micro_batches)
    return launch(parallel_train, world_size, recipe, quiet=quiet, ep=ep, micro_batches=micro_batches, **kwargs)


def predicted_exchange_bytes(counts: torch.Tensor, width: int, ep: int, element_size: int = 4) -> dict:
    """Bytes each EP rank sends in one exchange, {"dispatch": (ep,), "combine": (ep,)}, from ``counts`` (ep, E): row
    r = the token-choices EP rank r sends to each expert. Dispatch (and the combine's backward): M·b·Σ_{e not on r}
    counts[r, e]; combine (and the dispatch's backward): what arrived, M·b·Σ_{s ≠ r} counts[s, r's experts].
    Uniform routing, counts k·T/E: both k·T·M·b·(ep−1)/ep."""
    per = counts.shape[1] // ep
    by_rank = counts.reshape(ep, ep, per).sum(-1)                  # [source][destination rank]
    mine = by_rank.diagonal()
    return {"dispatch": (by_rank.sum(1) - mine) * width * element_size,
            "combine": (by_rank.sum(0) - mine) * width * element_size}

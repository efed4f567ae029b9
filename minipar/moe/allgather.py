"""The all-gather token dispatcher: dropless expert parallelism with no all-to-all and no split sizes.

Megatron-Core's ``MoEAllGatherTokenDispatcher``, beside the all-to-all of :mod:`minipar.moe.dropless`. Per MoE
layer, on an EP group of ep ranks, each with T tokens (width M, top-k, E/ep local experts, b bytes per element):

1. each rank routes its own tokens (dropless: no capacity);
2. **all-gather** the group's tokens (ep·T, M), their chosen experts and their gates (sequence parallelism's g:
   all-gather forward, reduce-scatter backward, :func:`minipar.tensor.operators.gather_sequence`);
3. each rank runs its local experts on the gathered token-choices routed to them (a grouped GEMM,
   :func:`minipar.moe.dropless.grouped_ffn`), weights them by their gates and adds them into a partial output
   for all ep·T tokens, zero where none of its experts was chosen;
4. **reduce-scatter** (SP's ḡ): the partial outputs summed over the group, each rank keeping its own T rows.

Bytes each rank sends per layer and training step (ring all-gather and reduce-scatter; forward + backward)::

    all-gather dispatcher:  4·(ep−1)·T·M·b  + 2·(ep−1)·T·k·b (gates) + (ep−1)·T·k·8 (expert ids)
    all-to-all dispatcher:  4·k·T·M·b·(ep−1)/ep  + E·(ep−1)/ep·8 (split sizes)   (uniform routing)

**When each pays.** The all-gather moves every token to every rank, whatever the routing: ep/k times the
all-to-all's bytes under uniform routing, so it pays when k ≥ ep (every rank would receive most tokens anyway)
or where latency, not bandwidth, rules: no split sizes to exchange first (no host sync), shapes known before the
routing, and no rank receives more than another — under the planted worst case (every token to one expert) the
all-to-all's owner of that expert receives k·(ep−1)·T rows per exchange, the all-gather's every rank (ep−1)·T.
Gradients, balancing and training are :mod:`minipar.moe.expert_parallel`'s.
"""
from __future__ import annotations

import torch

from .. import comm
from ..launcher import launch
from ..tensor.operators import all_gather_dim, gather_sequence, scatter_sequence
from . import dropless
from . import expert_parallel as epm
from .balance import z_loss
from .router import route

__all__ = ["AllGatherMoE", "validate", "build", "parallel_train", "run", "predicted_bytes"]


class AllGatherMoE(epm.ExpertParallelMoE):
    """An expert-parallel MoE layer whose tokens reach their experts by all-gather and come back by
    reduce-scatter (module docstring). ``last_path``: how the local experts last ran."""

    last_path = None

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        self.routing = route(logits, self.moe.k, cap=flat.shape[0], bias=getattr(self, "routing_bias", None))
        self.aux_loss = self.balance_loss(self.routing)
        if self.moe.z_loss:
            self.aux_loss = self.aux_loss + z_loss(logits, self.moe.z_loss)
        y = self.experts_on_gathered(flat, self.routing.expert, self.routing.gate)
        for expert in self.shared:
            y = y + expert(flat)
        return y.view(shape)

    def experts_on_gathered(self, flat, expert, gate):
        """Σ_j gate_tj · expert_{e_tj}(x_t) for this rank's T tokens, computed where the experts live."""
        group, tag = self.ep_group, self.log_mesh("ep")
        with epm.logged_with(tag):
            if group is not None:                              # (ep·T, ·), rank-major
                flat = gather_sequence(flat.unsqueeze(0), group).squeeze(0)
                gate = gather_sequence(gate.unsqueeze(0), group).squeeze(0)
                expert = all_gather_dim(expert.contiguous(), 0, group)
        k = expert.shape[1]
        local = expert.reshape(-1) - self.first                # local expert index, or out of range
        chosen = ((local >= 0) & (local < self.per_rank)).nonzero(as_tuple=True)[0]
        order = chosen[torch.argsort(local[chosen], stable=True)]          # my token-choices, by local expert
        counts = torch.bincount(local[order], minlength=self.per_rank).tolist()
        out, self.last_path = dropless.grouped_ffn(list(self.experts.children()), flat[order // k], counts)
        weighted = out * gate.reshape(-1)[order].unsqueeze(-1)
        partial = flat.new_zeros(flat.shape).index_add(0, order // k, weighted)
        if group is None:
            return partial
        with epm.logged_with(tag):
            return scatter_sequence(partial.unsqueeze(0), group).squeeze(0)   # Σ over ranks, my T rows


def validate(recipe, *, world_size: int, ep: int, micro_batches: int = 1) -> None:
    """:func:`minipar.moe.dropless.validate`: a dropless MoE recipe (the all-gather dispatcher has no capacity)."""
    dropless.validate(recipe, world_size=world_size, ep=ep, micro_batches=micro_batches)


def build(rank: int, world_size: int, recipe, ep: int):
    """This rank's model (its experts only, in :class:`AllGatherMoE` layers), {local: reference} names, mesh."""
    return epm.build(rank, world_size, recipe, ep, layer=AllGatherMoE)


def parallel_train(rank: int, world_size: int, recipe, *, ep: int, micro_batches: int = 1,
                   step_log: comm.CommLog | None = None, routings: list | None = None):
    """:func:`minipar.moe.expert_parallel.parallel_train` with all-gather dispatch (its ``step_log``, ``routings``)."""
    validate(recipe, world_size=world_size, ep=ep, micro_batches=micro_batches)
    return epm.parallel_train(rank, world_size, recipe, ep=ep, micro_batches=micro_batches, step_log=step_log,
                              routings=routings, layer=AllGatherMoE)


def run(recipe, *, world_size: int, ep: int, micro_batches: int = 1, quiet: bool = True, **kwargs) -> list:
    """Validate, then :func:`parallel_train` on ``world_size`` ranks; the per-rank results."""
    validate(recipe, world_size=world_size, ep=ep, micro_batches=micro_batches)
    return launch(parallel_train, world_size, recipe, quiet=quiet, ep=ep, micro_batches=micro_batches, **kwargs)


def predicted_bytes(tokens: int, width: int, k: int, experts: int, ep: int, element_size: int = 4) -> dict:
    """Per rank, per MoE layer, per training step (module docstring): {"allgather", "alltoall"} (all-to-all under
    uniform routing), both with their small terms (gates and ids; split sizes)."""
    b, t = element_size, tokens
    return {"allgather": (ep - 1) * t * (4 * width * b + 2 * k * b + 8 * k),
            "alltoall": (ep - 1) / ep * (4 * k * t * width * b + 8 * experts)}


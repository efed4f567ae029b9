"""Expert parallelism (EP): the experts of every MoE layer spread over ranks, tokens sent to them by all-to-all.

World = dp × ep ranks (``Mesh(world, dp=.., ep=..)``: rank = d·ep + e; groups from the mesh: ``group("ep")``
for the all-to-all, ``group("dp")`` for an expert's replicas, ``group("dp", "ep")`` for every data-parallel rank). Every rank holds the non-expert
parameters (attention, embeddings, routers, LayerNorms) and reads its own 1/world of the global batch, as in
data parallelism; within an EP group of ``ep`` ranks, rank e holds experts e·E/ep … (e+1)·E/ep − 1 of every
MoE layer, and ranks with the same e in different EP groups hold replicas of the same experts. Per MoE layer:

1. each rank routes its own T tokens and fills its dispatch buffer (E, C, M), C = ⌈k·T/E·cf⌉ per expert;
2. **all-to-all (dispatch)**: the buffer's chunk for the experts of EP rank j goes to rank j; each rank then
   holds, for each of its E/ep experts, the ep·C slots the EP group sent it;
3. the local experts run;
4. **all-to-all (combine)**, the inverse exchange: outputs go back to the ranks whose tokens they are, and
   each rank combines them as on one device. In backward the two exchanges run again, reversed.

**Padded to capacity, not variable sizes.** Buffers have the fixed shape (E, C, M) whatever the routing, so
one all-to-all of equal chunks moves them, with no preliminary exchange of counts, its size known in
advance, and autograd's backward is the same exchange again. The price: empty slots travel (and are
computed) too. The alternative — exchange the per-expert counts first (an all-to-all of E integers), then
move exactly the tokens routed ("dropless", Megatron-Core/MegaBlocks) — sends only real tokens but needs two
rounds and shapes known only at run time: :mod:`minipar.moe.dropless`. (Gloo's list ``all_to_all`` wants equal
chunks; the uneven one is ``all_to_all_single`` with split sizes.) Bytes each rank
sends per MoE layer per training step (T tokens per rank, M model width, b bytes per element)::

    dispatch direction: forward dispatch + backward of combine = 2 · E·C·M·b ≈ 2·k·cf·T·M·b
    combine direction:  forward combine + backward of dispatch  = the same

of which the chunk a rank keeps for its own experts, 1/ep of it, never leaves the rank.

**Capacity is per rank.** Each rank fills its C slots per expert from its own T tokens (GShard's routing
*groups*), so with dropping it drops other tokens than one device routing the whole batch at once. With
``MoEConfig(groups=W)`` the one-device model routes its batch in the same W groups and the two agree even
when tokens are dropped (``tests/test_expert_parallel.py``); with C ≥ T nothing is dropped and they agree
whatever the grouping.

**Gradients.** The loss is the mean over the world's ranks of their local losses, so every gradient is
divided by the world size W. Non-expert parameters: all-reduce over all W data-parallel ranks (the dp × ep
group), ÷ W. An expert's gradient already holds the contributions of every token of its EP group (they
reached it through the all-to-all); all-reduce over its replicas (the expert-data-parallel group, dp), and
divide by **W, not dp** — the classic scaling bug.

**Bytes.** Strategies log every exchange with :mod:`minipar.comm`; ``parallel_train(step_log=log)`` records
with the mesh, so each record names its group's dims and ``log.select(op="all_to_all")`` is the all-to-all
traffic, modelled and observed per call, with no log threaded through the layers.

**Shared experts** (``MoEConfig(shared=S)``, DeepSeekMoE) see every token of their own rank: they are dense
parameters, held by every rank and averaged over all W ranks like attention. Loss-free balancing
(``bias_rate``): each rank keeps the same bias and moves it after each step from the whole batch's load (its
token choices all-reduced over the data-parallel ranks: :meth:`ExpertParallelMoE.update_bias`).

**Load-balancing loss.** f_i counts first choices over the whole micro-batch of all W ranks (an all-reduce
of E numbers), P_i is each rank's own mean probability; each rank's α·E·Σ f_i·P_i, averaged over ranks
with the rest of the loss, is the whole micro-batch's aux loss and has its gradient. (Computing f per rank
instead — Switch's per-device groups — is a valid loss too, but a different one for each world size.)

Lepikhin et al. 2020, GShard (arXiv:2006.16668); Fedus et al. 2021, Switch Transformers (arXiv:2101.03961).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..check import one_thread, train_steps
from ..recipe import RunResult
from ..launcher import launch
from ..loop import shard_batch
from ..mesh import Mesh
from ..validation import positive_int
from .layer import MoEGPT, MoELayer, validate_config
from .balance import update_bias
from .router import Routing, balance_counts, capacity, load_balancing_loss

__all__ = ["ExpertParallelMoE", "AllToAll", "exchange", "all_to_all", "logged_with", "shard_experts", "is_expert",
           "sync_gradients", "validate", "build", "train_step", "parallel_train", "run",
           "predicted_all_to_all_bytes", "loss_free_reference"]


class AllToAll(torch.autograd.Function):
    """Chunk i of dim 0 goes to rank i of ``group``; backward sends the gradient chunks back the same way.
    ``log_mesh`` (optional): the mesh each exchange, forward and backward, is recorded with (its dims)."""

    @staticmethod
    def forward(ctx, x, group, log_mesh=None):
        ctx.group, ctx.log_mesh = group, log_mesh
        with logged_with(log_mesh):
            return exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        with logged_with(ctx.log_mesh):
            return exchange(grad, ctx.group), None, None


def logged_with(log_mesh):
    """``comm.recording(mesh=log_mesh)`` (records name the dims ``log_mesh`` gives them), or nothing when None."""
    return contextlib.nullcontext() if log_mesh is None else comm.recording(mesh=log_mesh)


def exchange(x, group):
    """Chunk i of ``x`` (dim 0, ``group``-size equal chunks) to rank i; returns the chunks received, in
    rank order. One :func:`minipar.comm.all_to_all` (logged, with its group, by any recording around it)."""
    n = dist.get_world_size(group)
    send = [c.contiguous() for c in x.chunk(n)]
    received = [torch.empty_like(c) for c in send]
    comm.all_to_all(received, send, group=group)
    return torch.cat(received)


def all_to_all(x: torch.Tensor, group, log_mesh=None) -> torch.Tensor:
    """Differentiable all-to-all of ``x``'s dim-0 chunks over ``group`` (recorded with ``log_mesh`` if given)."""
    return AllToAll.apply(x, group, log_mesh)


class ExpertParallelMoE(MoELayer):
    """An MoE layer holding only experts ``first … first + E/ep − 1``; the others live on the EP peers."""

    def __init__(self, layer: MoELayer, ep_rank: int, ep: int, ep_group, token_group):
        nn.Module.__init__(self)
        self.moe, self.router = replace(layer.moe, groups=1), layer.router   # a rank's tokens: one group
        self.per_rank = layer.moe.experts // ep
        self.first = ep_rank * self.per_rank
        self.experts = nn.ModuleList(layer.experts[self.first: self.first + self.per_rank])
        self.shared = layer.shared                # shared experts: dense, on every rank (DeepSeekMoE)
        self.ep_group, self.token_group = ep_group, token_group
        self.routing, self.aux_loss = None, torch.zeros((), device=layer.router.weight.device)
        if layer.moe.bias_rate > 0:               # loss-free balancing: the same bias on every rank
            self.register_buffer("routing_bias", layer.routing_bias.clone())

    def update_bias(self) -> None:
        """Loss-free balancing under EP: the load is the whole batch's — every rank's token choices summed over
        the token group (an all-reduce of E counts) — so every rank moves its copy of the bias alike."""
        load = self.routing.wanted().to(self.routing_bias.dtype)
        with logged_with(self.log_mesh("balance")):
            comm.all_reduce(load, group=self.token_group)
        update_bias(self.routing_bias, load, self.moe.bias_rate)

    def log_mesh(self, kind: str):
        """The mesh the exchanges of ``kind`` ("ep": the all-to-alls, "balance": the f counts) are recorded
        with; None (the default): whatever recording is around them names their dims."""
        return None

    def balance_loss(self, routing: Routing) -> torch.Tensor:
        counts = balance_counts(routing)
        with logged_with(self.log_mesh("balance")):
            comm.all_reduce(counts, group=self.token_group)       # first choices over the whole micro-batch
        total = routing.probs.shape[0] * dist.get_world_size(self.token_group)
        return load_balancing_loss(routing, self.moe.alpha, counts, total)

    def run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
        experts = list(self.experts.children())         # a ModuleList, or a ModuleDict keyed by global index
        if self.ep_group is None:                        # no EP group: every expert is here
            return torch.stack([expert(buffer[e]) for e, expert in enumerate(experts)])
        e, c, m = buffer.shape
        ep, tag = e // self.per_rank, self.log_mesh("ep")
        received = all_to_all(buffer, self.ep_group, tag)    # (ep sources × E/ep experts, C, M)
        received = received.view(ep, self.per_rank, c, m)
        out = torch.stack([expert(received[:, j].reshape(ep * c, m)).view(ep, c, m)
                           for j, expert in enumerate(experts)], dim=1)
        return all_to_all(out.reshape(e, c, m), self.ep_group, tag)   # back to the tokens' ranks


def shard_experts(model: MoEGPT, ep_rank: int, ep: int, ep_group, token_group, layer=None) -> dict:
    """Replace every MoE layer by its expert-parallel slice (a ``layer``, default :class:`ExpertParallelMoE`), in
    place. Returns {local name: reference name} for the parameters this rank holds (local expert j of block b is
    global expert first + j)."""
    names = {}
    for b in model.moe_blocks():
        ep_layer = (layer or ExpertParallelMoE)(model.blocks[b].mlp, ep_rank, ep, ep_group, token_group)
        model.blocks[b].mlp = ep_layer
        for j in range(ep_layer.per_rank):
            for n, _ in ep_layer.experts[j].named_parameters():
                names[f"blocks.{b}.mlp.experts.{j}.{n}"] = f"blocks.{b}.mlp.experts.{ep_layer.first + j}.{n}"
    for n, _ in model.named_parameters():
        names.setdefault(n, n)
    return names


def is_expert(name: str) -> bool:
    return ".experts." in name


def sync_gradients(model: nn.Module, dense_group, expert_group, world_size: int) -> None:
    """Mean of the ranks' gradients: non-expert over every data-parallel rank (``dense_group``, dp × ep),
    experts over their replicas (``expert_group``, dp); both ÷ W. One flat all-reduce per kind."""
    for expert, group in ((False, dense_group), (True, expert_group)):
        params = [p for n, p in model.named_parameters() if is_expert(n) == expert]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        if grads and dist.get_world_size(group) > 1:
            comm.all_reduce_flat(grads, group=group)
        for g in grads:
            g /= world_size


def validate(recipe, *, world_size: int, ep: int, micro_batches: int = 1) -> None:
    """ValueError before any process starts: EP size not dividing the world or the experts, top-k > E,
    cf ≤ 0 (checked by :func:`minipar.moe.layer.validate_config`), batches not splitting evenly."""
    positive_int("world_size", world_size)
    positive_int("micro_batches", micro_batches)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or world_size % ep:
        raise ValueError(f"EP size {ep!r} must be a positive divisor of the world size {world_size} "
                         f"(world = dp × ep)")
    model = recipe.model()
    if not isinstance(model, MoEGPT):
        raise ValueError(f"expert parallelism needs an MoEGPT recipe (minipar.moe.layer.moe_recipe), "
                         f"got a {type(model).__name__}")
    validate_config(model.moe, ep)
    if model.moe.bias_rate > 0 and micro_batches > 1:
        raise ValueError("loss-free balancing moves its bias from one forward's load: with micro_batches > 1 each "
                         "rank would see only its last micro-batch's; use micro_batches=1")
    for step, (inputs, _) in enumerate(recipe.batches):
        if inputs.shape[0] % (world_size * micro_batches):
            raise ValueError(f"global batch {step} has {inputs.shape[0]} rows: not divisible by {world_size} "
                             f"ranks x {micro_batches} micro-batches")


def build(rank: int, world_size: int, recipe, ep: int, layer=None):
    """This rank's model (its experts only, in ``layer`` s), the {local: reference} parameter names and its mesh."""
    mesh = Mesh(world_size, dp=world_size // ep, ep=ep).build(rank)
    model = recipe.model().to(recipe.dtype)
    names = shard_experts(model, mesh.coord("ep"), ep, mesh.group("ep"), mesh.group("dp", "ep"), layer)
    return model, names, mesh


def train_step(model, recipe, inputs, targets, micro_batches: int, mesh, world_size: int,
               routings: list | None = None) -> torch.Tensor:
    """Forward and backward of this rank's rows in ``micro_batches`` micro-batches, then the gradient
    averaging; returns the local loss (float64). The optimizer step is the caller's."""
    local = torch.zeros((), dtype=torch.float64)
    for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
        loss = recipe.loss(model, x, y) / micro_batches
        loss.backward()
        local += loss.detach().double()
        if routings is not None:
            routings.append([(layer.routing.load(), layer.routing.dropped) for layer in model.moe_layers()])
    sync_gradients(model, mesh.group("dp", "ep"), mesh.group("dp"), world_size)
    return local


def parallel_train(rank: int, world_size: int, recipe, *, ep: int, micro_batches: int = 1,
                   step_log: comm.CommLog | None = None, routings: list | None = None, layer=None):
    """Train ``recipe`` with EP (× DP = world/ep), MoE layers of class ``layer`` (:func:`build`). ``step_log`` records every exchange of the training steps,
    tagged with the mesh dims of its group (``step_log.select(op="all_to_all")``: the layers' all-to-alls);
    ``routings`` collects, per micro-batch, each MoE layer's (tokens per expert, dropped) on this rank."""

    validate(recipe, world_size=world_size, ep=ep, micro_batches=micro_batches)
    model, names, mesh = build(rank, world_size, recipe, ep, layer)
    opt = recipe.optimizer(model.parameters())
    losses = []
    for batch in recipe.batches:
        inputs, targets = shard_batch(batch, rank, world_size)
        with comm.recording(step_log, mesh=mesh) if step_log is not None else contextlib.nullcontext():
            opt.zero_grad(set_to_none=True)
            local = train_step(model, recipe, inputs, targets, micro_batches, mesh, world_size, routings)
            opt.step()
            model.update_routing_bias()          # loss-free balancing (bias_rate > 0): after the step
        comm.all_reduce(local)
        losses.append(local.item() / world_size)
    return RunResult(losses, {names[n]: p.detach().clone() for n, p in model.named_parameters()})


def run(recipe, *, world_size: int, ep: int, micro_batches: int = 1, quiet: bool = True, **kwargs) -> list:
    """Validate, then :func:`parallel_train` on ``world_size`` ranks; the per-rank results."""
    validate(recipe, world_size=world_size, ep=ep, micro_batches=micro_batches)
    return launch(parallel_train, world_size, recipe, quiet=quiet, ep=ep, micro_batches=micro_batches, **kwargs)


def predicted_all_to_all_bytes(tokens: int, width: int, moe, ep: int, element_size: int = 4) -> dict:
    """Per rank, per MoE layer, per training step, **per direction** (dispatch or combine; the step moves
    as much again the other way): the formula 2·k·cf·T·M·b, the padded buffers 2·E·C·M·b really exchanged
    (C rounded up), and ``wire``, the part that leaves the rank ((ep−1)/ep of it: a rank's own chunk stays)."""
    c = capacity(tokens, moe.experts, moe.capacity_factor, moe.k)
    formula = 2 * moe.k * moe.capacity_factor * tokens * width * element_size
    buffer = 2 * moe.experts * c * width * element_size
    return {"formula": formula, "buffer": buffer, "wire": buffer * (ep - 1) / ep, "capacity": c}


def loss_free_reference(recipe):
    """One device, its loss-free routing bias moved after every step: (RunResult, the biases at the end)."""
    with one_thread():                                # as every rank runs: bit-comparable sums
        model = recipe.model().to(recipe.dtype)
        result = train_steps(recipe, model, recipe.optimizer(model.parameters()), recipe.batches,
                             after_step=lambda m: m.update_routing_bias())
    return result, [layer.routing_bias.clone() for layer in model.moe_layers()]

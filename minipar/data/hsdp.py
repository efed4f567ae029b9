"""Two levels: shard inside a node, replicate across nodes — HSDP and the hierarchical all-reduce.

A cluster's links are not equal: inside a node GPUs talk over NVLink (hundreds of GB/s), between nodes over
InfiniBand (tens). A flat collective over all N = n·g ranks (n nodes of g) puts the node boundary inside its
ring, so every byte of the collective's slowest step crosses it. Two-level schemes keep the heavy part inside
the node and send only a 1/g slice across:

* **hierarchical all-reduce** (Horovod's and NCCL's tree/ring hierarchies; Goyal et al. 2017): reduce-scatter
  inside the node, all-reduce each 1/g shard across the nodes (g independent rings, one per local rank), then
  all-gather inside the node. The sum over all N ranks, exactly.
* **HSDP** (hybrid sharded data parallelism: PyTorch FSDP's ``HYBRID_SHARD``, FSDP2's 2-D mesh
  ``dp_replicate × dp_shard``, torchtitan's mesh; ZeRO++'s hpZ is the same idea for the weights): ZeRO-3
  inside each node, plain data parallelism across: the parameters' all-gathers and the gradients'
  reduce-scatter stay in the node, and each rank all-reduces its 1/g gradient shard with the ranks holding the
  same shard on the other nodes. Memory: Ψ/g per rank instead of Ψ/N.

Bytes that cross node boundaries per step, summed over all ranks, S = the gradient's bytes, rings in rank
order (the boundary links of an N-rank ring: n of them):

    flat ring all-reduce        n · 2(N−1)/N · S          (each boundary link carries a whole ring's traffic)
    hierarchical all-reduce     N · 2(n−1)/n · S/g = 2(n−1) · S
    flat FSDP (ZeRO-3 over N)   n · 3(N−1)/N · S          (two all-gathers and a reduce-scatter)
    HSDP                        2(n−1) · S                (the shards' all-reduce; nothing else crosses)

Measured here: every collective runs on minipar's send/recv rings (``comm.ring_algorithms()``), so each message
has a destination, and the bytes a rank sends to a rank on another node are summed from its ``send`` records
(the tensors it really handed to gloo for that peer) — the ranks are *declared* n nodes of g; on this machine
they all share one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import comm
from ..recipe import RunResult
from ..flat import FlatLayout
from ..launcher import launch
from ..loop import mean_over_ranks, shard_batch
from ..validation import positive_int
from .zero import ZeRO, block_units

__all__ = ["node_groups", "hierarchical_all_reduce", "cross_node_bytes", "CROSS_NODE_FORMULAS", "MODES",
           "HSDPRun", "validate", "parallel_train", "run"]

MODES = ("ddp", "ddp hierarchical", "fsdp", "hsdp")


def node_groups(world_size: int, per_node: int) -> tuple:
    """(node group, cross group) of this rank: the g ranks of its node, and the n ranks with its local index
    on every node. Every rank creates every group, in the same order (``new_group`` is collective)."""
    nodes = world_size // per_node
    mine = dist.get_rank()
    node = cross = None
    for k in range(nodes):
        g = dist.new_group(list(range(k * per_node, (k + 1) * per_node)))
        node = g if mine // per_node == k else node
    for i in range(per_node):
        g = dist.new_group(list(range(i, world_size, per_node)))
        cross = g if mine % per_node == i else cross
    return node, cross


def hierarchical_all_reduce(t: torch.Tensor, node_group, cross_group) -> torch.Tensor:
    """Σ over all ranks of ``t``, in place: reduce-scatter inside the node, all-reduce the shard across the
    nodes, all-gather inside the node. Only the shard (1/g of ``t``) crosses a node boundary."""
    layout = FlatLayout([t.shape], dist.get_world_size(node_group))    # padded to g shards
    padded = layout.flatten([t])
    shard = padded.new_empty(layout.shard_numel)
    comm.reduce_scatter_tensor(shard, padded, group=node_group)     # inside the node: my 1/g, summed over g
    comm.all_reduce(shard, group=cross_group)                       # across: the same 1/g on every node
    comm.all_gather_into_tensor(padded, shard, group=node_group)    # inside the node: everyone's 1/g
    return layout.unflatten(padded, [t])[0]


def cross_node_bytes(records, rank: int, per_node: int) -> int:
    """Bytes this rank's ``send`` records carried to ranks on another node (records from a ``comm.CommLog``)."""
    total = 0
    for r in records:
        if r.op == "send":
            peer = next(x for x in r.ranks if x != rank)
            total += r.sent_bytes if peer // per_node != rank // per_node else 0
    return total


# Bytes crossing node boundaries per step, all ranks together: S bytes of gradient, N ranks in n nodes of g.
CROSS_NODE_FORMULAS = {
    "ddp": lambda S, N, n: n * 2 * (N - 1) / N * S,
    "ddp hierarchical": lambda S, N, n: 2 * (n - 1) * S,
    "fsdp": lambda S, N, n: n * 3 * (N - 1) / N * S,
    "hsdp": lambda S, N, n: 2 * (n - 1) * S,
}


@dataclass
class HSDPRun(RunResult):
    """A rank's :class:`RunResult` plus, per step, the bytes it sent across nodes, in all and on the wire, and
    the bytes of model parameters it holds between steps (its shard under FSDP/HSDP)."""
    cross_node: list = field(default_factory=list)
    sent: list = field(default_factory=list)
    observed: list = field(default_factory=list)      # what the sockets carried (minipar.wire), or None
    param_bytes: int = 0


def validate(recipe, *, world_size: int, per_node: int, mode: str) -> None:
    positive_int("per_node", per_node)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if world_size % per_node or world_size // per_node < 2:
        raise ValueError(f"{world_size} ranks do not make two or more nodes of {per_node}: two levels need both")
    if len(recipe.batches[0][0]) % world_size:
        raise ValueError(f"the global batch of {len(recipe.batches[0][0])} does not split over {world_size} ranks")


def parallel_train(rank, world_size, recipe, *, per_node: int, mode: str) -> HSDPRun:
    """Train ``recipe`` on ``world_size`` ranks declared as nodes of ``per_node``, the gradients reduced by
    ``mode``: "ddp" (a flat ring all-reduce), "ddp hierarchical", "fsdp" (ZeRO-3 over all ranks) or "hsdp"."""
    node, cross = node_groups(world_size, per_node)
    model = recipe.model().to(recipe.dtype)
    if mode in ("fsdp", "hsdp"):
        zero = ZeRO(model, recipe.optimizer, 3, None if mode == "fsdp" else node, block_units(model),
                    replicate_group=cross if mode == "hsdp" else None)
        optimizer = zero.optimizer
    else:
        zero, optimizer = None, recipe.optimizer(list(model.parameters()))
    out = HSDPRun([])
    for batch in recipe.batches:
        x, y = shard_batch(batch, rank, world_size)
        with comm.ring_algorithms(), comm.recording() as log:
            if zero is not None:
                zero.zero_grad()
            else:
                optimizer.zero_grad(set_to_none=True)
            loss = recipe.loss(model, x, y)
            loss.backward()
            if zero is not None:
                zero.step()                          # ZeRO-3: reduce-scatter (+ HSDP's all-reduce across), step
            else:
                grads = [p.grad for p in model.parameters()]
                layout = FlatLayout([g.shape for g in grads])
                flat = layout.flatten(grads) / world_size
                if mode == "ddp":
                    comm.all_reduce(flat)
                else:
                    hierarchical_all_reduce(flat, node, cross)
                layout.unflatten(flat, grads)        # the mean gradient, back in place
                optimizer.step()
        out.cross_node.append(cross_node_bytes(log.records, rank, per_node))
        out.sent.append(sum(r.sent_bytes for r in log.records if r.op == "send"))
        out.observed.append(log.observed_bytes_sent)
        out.losses.append(mean_over_ranks(loss.detach()))
    out.params = zero.full_parameters() if zero is not None else {n: p.detach().clone() for n, p in model.named_parameters()}
    held = [u.master for u in zero.units] if zero is not None else list(model.parameters())
    out.param_bytes = sum(t.numel() * t.element_size() for t in held)
    return out


def run(recipe, *, world_size: int, per_node: int, mode: str, quiet: bool = True) -> list:
    """Check the configuration, then train: per-rank :class:`HSDPRun`."""
    validate(recipe, world_size=world_size, per_node=per_node, mode=mode)
    return launch(parallel_train, world_size, recipe, per_node=per_node, mode=mode, quiet=quiet)

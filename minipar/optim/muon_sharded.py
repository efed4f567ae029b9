"""Muon under ZeRO-1 and per-parameter FSDP: Newton–Schulz needs the whole matrix, the sharding gives a rank
rows of it. Four ways out, three right (equal to one device's Muon, :mod:`.muon`) and one wrong.

Placements over the N ranks of the data-parallel group. ``rows``: every parameter split on dim 0, rank r
holding rows [r·d₀/N, (r+1)·d₀/N) of its optimizer state (ZeRO-1: the parameters stay whole on every rank;
FSDP: only the rows stay between steps). ``whole``: parameter i (in ``named_parameters`` order) lives whole on
rank i mod N. The Muon step on a piece, given the piece's gradient (the rows of U are elementwise, :mod:`.muon`):

    per_shard  (rows)   O = NS(U_rows), scaled by the rows' shape: another optimizer (tests: how far off)
    gather     (rows)   all-gather U; every rank orthogonalises the whole matrix and keeps its rows
    owner      (rows)   matrix m's owner o_m = m mod N gathers U, orthogonalises, scatters the rows back
                        (owner-compute: minipar's variant, the optimizer state stays in rows)
    whole      (whole)  the owner holds gradient, state and matrix: it orthogonalises, nothing gathered
                        (nanochat's DistMuon: whole gradients reduce-scattered to an owner chosen block-cyclically,
                        momentum kept there only, the updated matrices all-gathered)

A step. ZeRO-1, rows: forward/backward on 1/N of the batch, reduce-scatter each gradient (÷N), the step on
the rows, all-gather the rows into the parameter. FSDP, rows: all-gather the rows into the parameters, forward,
backward, reduce-scatter, step (the whole model is one unit: freed after the step). ``whole``: reduce each
gradient to its owner, the owner steps, broadcast from the owner (ZeRO-1: after the step; FSDP: before forward).

Bytes sent per rank per step, b bytes an element, S_p = b·numel(p), o_p = p's owner (:func:`bytes_per_step`)::

    rows    Σ_p 2(N−1)/N·S_p                                         reduce-scatter + all-gather
    whole   Σ_p ([r≠o_p]·S_p + [r=o_p]·(N−1)·S_p)                    reduce (direct) + broadcast from the owner
    Muon    gather Σ_m (N−1)/N·S_m;  owner Σ_m ([r≠o_m]·S_m/N + [r=o_m]·(N−1)/N·S_m);  per_shard, whole 0
    + the loss's all-reduce, 2(N−1)/N·8

Optimizer state per rank (:func:`state_bytes`): rows Σ_m S_m/N + Σ_a 2·S_a/N (a: AdamW's parameters, two
moments); whole Σ_{p: o_p = r} (1 or 2)·S_p. And beside it what the step gathers: ``gather`` a whole U of
every matrix on every rank, ``owner`` only on the matrix's owner (ranks owning no matrix gather nothing).

Sources: Keller Jordan, "Muon" (2024); Liu et al., "Muon is Scalable for LLM Training" (2025, arXiv:2502.16982:
distributed Muon gathers the ZeRO-1 shards, orthogonalises, keeps the local part); nanochat's DistMuon
(``whole``, karpathy/nanochat muon.py); Rajbhandari et al., "ZeRO" (2020); Zhao et al., "PyTorch FSDP" (2023).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..launcher import launch
from ..loop import mean_over_ranks, shard_batch
from ..recipe import Recipe, RunResult
from .muon import MuonFactory, adamw, apply_update, momentum_update, newton_schulz

__all__ = ["METHODS", "SHARDINGS", "ShardedMuon", "validate", "parallel_train", "run", "bytes_per_step",
           "state_bytes", "owners"]

METHODS = ("per_shard", "gather", "owner", "whole")
SHARDINGS = ("zero1", "fsdp")


def validate(recipe: Recipe, *, world_size: int, sharding: str = "zero1", method: str = "owner") -> None:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding {sharding!r}: use one of {SHARDINGS}")
    if method not in METHODS:
        raise ValueError(f"method {method!r}: use one of {METHODS}")
    if not isinstance(recipe.optimizer, MuonFactory):
        raise ValueError("the recipe's optimizer must be a minipar.optim.muon.MuonFactory (muon_recipe)")
    if world_size < 1 or any(len(b[0]) % world_size for b in recipe.batches):
        raise ValueError(f"every global batch must split evenly over {world_size} ranks")
    if method != "whole":
        for name, p in recipe.model().named_parameters():
            if p.shape[0] % world_size:
                raise ValueError(f"{name}: {p.shape[0]} rows do not split over {world_size} ranks")


def owners(names, hidden, method: str, n: int) -> dict:
    """{name: owning rank} for the parameters that have one: every parameter under ``whole`` (i mod N), the
    Muon matrices under ``owner`` (m mod N, m counting Muon matrices only)."""
    if method == "whole":
        return {name: i % n for i, name in enumerate(names)}
    if method == "owner":
        return {name: m % n for m, name in enumerate(x for x in names if x in hidden)}
    return {}


class ShardedMuon:
    """One rank's model, its pieces of the parameters and their Muon momentum / AdamW moments, over ``group``."""

    def __init__(self, model, factory: MuonFactory, group, sharding: str, method: str):
        self.model, self.cfg, self.group = model, factory.config, group
        self.sharding, self.method = sharding, method
        self.n, self.r = dist.get_world_size(group), dist.get_rank(group)
        self.params = dict(model.named_parameters())
        self.hidden = factory.hidden
        self.owner = owners(factory.names, self.hidden, method, self.n)
        self.shapes = {name: p.shape for name, p in self.params.items()}
        self.pieces = {}                     # name -> this rank's piece (rows, or the whole on its owner)
        for name, p in self.params.items():
            if method != "whole":
                self.pieces[name] = p.detach().chunk(self.n)[self.r].clone().requires_grad_()
            elif self.owner[name] == self.r:
                self.pieces[name] = p.detach().clone().requires_grad_()
        self.momentum = {name: torch.zeros_like(t) for name, t in self.pieces.items() if name in self.hidden}
        others = [t for name, t in self.pieces.items() if name not in self.hidden]
        self.adam = adamw(others, self.cfg) if others else None
        if sharding == "fsdp":
            self.free_params()

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    # -- the parameters: whole for forward/backward, pieces between ------------------------------------
    @torch.no_grad()
    def gather_params(self) -> None:
        for name, p in self.params.items():
            if p.numel() != self.shapes[name].numel():
                p.data = torch.empty(self.shapes[name], dtype=p.dtype)
            if self.method == "whole":
                if self.owner[name] == self.r:
                    p.copy_(self.pieces[name])
                comm.broadcast(p.data, src=self._global(self.owner[name]), group=self.group)
            else:
                comm.all_gather_into_tensor(p.data.view(-1), self.pieces[name].detach().reshape(-1), group=self.group)

    def free_params(self) -> None:
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Each piece's ``.grad``: the mean over the group of the gradients of its rows (or of its whole)."""
        for name, p in self.params.items():
            if self.method == "whole":
                comm.reduce(p.grad, dst=self._global(self.owner[name]), group=self.group)
                grad = p.grad if self.owner[name] == self.r else None
            else:
                grad = torch.empty_like(self.pieces[name])
                comm.reduce_scatter_tensor(grad.view(-1), p.grad.reshape(-1), group=self.group)
            if grad is not None:
                self.pieces[name].grad = grad.div_(self.n)
            p.grad = None

    # -- the optimizer step on the pieces ---------------------------------------------------------------
    @torch.no_grad()
    def optimizer_step(self) -> None:
        for name, buf in self.momentum.items():
            piece = self.pieces[name]
            ortho = self.orthogonalize(name, momentum_update(piece.grad, buf, self.cfg))
            apply_update(piece, ortho, self.cfg, piece.shape if self.method == "per_shard" else self.shapes[name])
        if self.adam is not None:
            self.adam.step()
        for piece in self.pieces.values():
            piece.grad = None

    def orthogonalize(self, name: str, update: torch.Tensor) -> torch.Tensor:
        """This rank's rows (or whole) of NS(U), U the whole matrix's update, ``update`` this rank's piece."""
        if self.method in ("per_shard", "whole"):
            return newton_schulz(update, self.cfg)          # per_shard: NS of the rows alone (wrong)
        rows = update.contiguous()
        if self.method == "gather":
            whole = torch.empty((self.n * rows.shape[0], rows.shape[1]), dtype=rows.dtype)
            comm.all_gather_into_tensor(whole.view(-1), rows.view(-1), group=self.group)
            return newton_schulz(whole, self.cfg).chunk(self.n)[self.r]
        owner, mine = self._global(self.owner[name]), self.owner[name] == self.r
        pieces = [torch.empty_like(rows) for _ in range(self.n)] if mine else None
        comm.gather(rows, pieces, dst=owner, group=self.group)
        chunks = [c.contiguous() for c in newton_schulz(torch.cat(pieces), self.cfg).chunk(self.n)] if mine else None
        out = torch.empty_like(rows, dtype=self.cfg.ns_dtype or rows.dtype)
        comm.scatter(out, chunks, src=owner, group=self.group)
        return out

    # -- a step and the result ---------------------------------------------------------------------------
    def train_step(self, recipe: Recipe, batch) -> float:
        inputs, targets = shard_batch(batch, self.r, self.n)
        if self.sharding == "fsdp":
            self.gather_params()
        loss = recipe.loss(self.model, inputs, targets)
        loss.backward()
        self.reduce_grads()
        self.optimizer_step()
        if self.sharding == "fsdp":
            self.free_params()
        else:
            self.gather_params()
        return mean_over_ranks(loss, self.group)

    def full_params(self) -> dict:
        if self.sharding == "fsdp":
            self.gather_params()
        return {name: p.detach().clone() for name, p in self.params.items()}

    def state_tensors(self) -> list:
        """The optimizer state this rank holds: Muon momenta and AdamW's moments."""
        adam = [] if self.adam is None else [t for s in self.adam.state.values() for t in s.values()
                                              if torch.is_tensor(t) and t.dim()]
        return list(self.momentum.values()) + adam


def parallel_train(rank, world_size, recipe: Recipe, *, sharding: str = "zero1", method: str = "owner",
                   group=None) -> RunResult:
    """Train ``recipe`` with Muon on ``group`` (default: all ranks); full parameters at the end."""
    group = group if group is not None else dist.group.WORLD
    trainer = ShardedMuon(recipe.model().to(recipe.dtype), recipe.optimizer, group, sharding, method)
    losses = [trainer.train_step(recipe, batch) for batch in recipe.batches]
    return RunResult(losses, trainer.full_params())


def run(recipe: Recipe, *, world_size: int, sharding: str = "zero1", method: str = "owner", **launch_kwargs):
    validate(recipe, world_size=world_size, sharding=sharding, method=method)
    return launch(parallel_train, world_size, recipe, sharding=sharding, method=method, **launch_kwargs)


def bytes_per_step(recipe: Recipe, *, world_size: int, method: str, rank: int) -> float:
    """The docstring's bytes one rank sends per step (ZeRO-1 and FSDP alike)."""
    n, factory = world_size, recipe.optimizer
    if n == 1:
        return 0.0
    sizes = {name: p.numel() * p.element_size() for name, p in recipe.model().to(recipe.dtype).named_parameters()}
    owner = owners(factory.names, factory.hidden, method, n)
    total = 2 * (n - 1) / n * 8
    for name, s in sizes.items():
        if method == "whole":
            total += (n - 1) * s if owner[name] == rank else s
        else:
            total += 2 * (n - 1) / n * s
        if name in factory.hidden and method == "gather":
            total += (n - 1) / n * s
        if name in factory.hidden and method == "owner":
            total += (n - 1) / n * s if owner[name] == rank else s / n
    return total


def state_bytes(recipe: Recipe, *, world_size: int, method: str, rank: int) -> int:
    """The docstring's optimizer-state bytes on ``rank``: one moment per Muon element, two per AdamW one."""
    factory = recipe.optimizer
    owner = owners(factory.names, factory.hidden, method, world_size)
    total = 0
    for name, p in recipe.model().to(recipe.dtype).named_parameters():
        moments = 1 if name in factory.hidden else 2
        if method == "whole":
            total += moments * p.numel() * p.element_size() if owner[name] == rank else 0
        else:
            total += moments * p.numel() * p.element_size() // world_size
    return total

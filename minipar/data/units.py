"""Units, the modules whose parameters ZeRO/FSDP gather and reduce together: the default wrapping
(:func:`block_units`), the check that they hold every trainable parameter (:func:`check_units`), and
:class:`UnitOrder`, the check that every rank runs every unit.

ZeRO-2/3 (:mod:`minipar.data.zero`) issue a unit's collectives from hooks — its all-gather when its forward or
backward begins (stage 3), its reduce-scatter when the gradient reaches its inputs — so the order of the
collectives is the order in which each rank's program reaches the units. A unit whose forward runs on some
ranks only (an MoE expert's block that only rank 0's tokens reach, a conditional branch) breaks that order:
rank 0 reduce-scatters blocks 1, 0, root, the others 0, then 1 at the end, root. A collective is matched by
position, so units of equal size pair the wrong buffers (a silently wrong gradient) and units of unequal size
abort gloo. PyTorch's FSDP requires every rank to run every unit; so does minipar, and checks it: before each
such collective the ranks all-reduce two int64 (which unit, which collective, :meth:`UnitOrder.agree`); when
they differ, **every** rank raises :class:`UnitOrderError` before the collective, naming the unit whose forward
some ranks skipped and those ranks. (A unit that no rank runs in a step is fine: every rank reduces it at the
end, in unit order.)

Cost, always on: one all-reduce of 16 bytes per unit collective, 2·16·(N-1)/N bytes sent per rank (ring model);
U of them per step under ZeRO-2 (one per reduce-scatter), up to 3U under ZeRO-3 (two all-gathers and a
reduce-scatter per unit): 96·U·(N-1)/N bytes per rank per step, next to the parameters' 3·b·Ψ·(N-1)/N. On the
wire gloo's framing makes it ~300-600 bytes per check (measured, 4 ranks): +1.0-1.3 % of the bytes of ZeRO-3 on
test_zero's small GPT. Its real price is one latency per check: median step 48 -> 72 ms for that GPT's ZeRO-3
(34 -> 45 ms ZeRO-2) on a loaded 2-core machine; the larger the units' compute, the smaller the share. It
goes through ``torch.distributed``, not :mod:`minipar.comm` (as the opt-in :mod:`minipar.debug.desync` check,
which compares every collective, does): the comm log keeps the algorithm's bytes. HSDP checks the replicate
group too. Per-parameter FSDP checks its all-gathers and its reduce-scatters the same way, wherever it posts
them (prefetched all-gathers included).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["block_units", "check_units", "UnitOrderError", "UnitOrder", "KINDS"]

KINDS = ("all-gather", "reduce-scatter")


def block_units(model: nn.Module) -> list:
    """The default wrapping: one unit per transformer block (``model.blocks``), then the root (the rest)."""
    return [*getattr(model, "blocks", []), model]


def check_units(model: nn.Module, modules) -> None:
    """ValueError unless every trainable parameter of ``model`` belongs to one of the units' ``modules``."""
    inside = {id(p) for m in modules for p in m.parameters()}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside]
    if missing:
        raise ValueError(f"parameters {missing[:3]} are in no unit; add the root module to the units "
                         f"(it takes whatever the other units leave)")


class UnitOrderError(RuntimeError):
    """The ranks were about to run a collective of different units (a unit some ranks skipped)."""


class UnitOrder:
    """The ranks of ``group`` (and of ``replicate_group``, HSDP) agree before each unit collective; ``units``
    (each with its ``module`` and ``label``) are numbered by position, the same on every rank. A forward pre-hook
    on each unit's module (put before the others) records the units this rank ran since ``new_step()``: what the
    error names. Per-parameter FSDP (:mod:`minipar.data.fsdp2`) checks its all-gathers the same way."""

    def __init__(self, units, group=None, replicate_group=None):
        self.units = list(units)
        self.groups = [group] + ([replicate_group] if replicate_group is not None else [])
        self.index = {id(u): i for i, u in enumerate(self.units)}
        self.ran, self.calls = set(), 0
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda m, args, u=unit: self.forward_began(u), prepend=True)

    def forward_began(self, unit) -> None:
        self.ran.add(self.index[id(unit)])

    def new_step(self) -> None:
        self.ran.clear()

    def agree(self, kind: str, unit) -> None:
        """Raise :class:`UnitOrderError` on every rank unless every rank is at ``kind`` of this same unit
        (``kind`` "free", no collective, passes): one all-reduce (max) of [code, -code], equal iff max = min."""
        if kind not in KINDS:
            return
        self.calls += 1
        code = self.index[id(unit)] * len(KINDS) + KINDS.index(kind)
        for group in self.groups:
            extremes = torch.tensor([code, -code], dtype=torch.int64)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)   # torch.distributed: not minipar.comm
            if extremes[0] == -extremes[1]:
                continue
            ran = torch.zeros(len(self.units), dtype=torch.int64)
            ran[sorted(self.ran)] = 1                          # rare path: who is where, for the message
            both = _all_gather(torch.cat([torch.tensor([code]), ran]), group)
            raise UnitOrderError(self.describe(both[:, :1].tolist(), both[:, 1:].tolist(), _ranks(group)))

    def describe(self, calls: list, ran: list, ranks: list) -> str:
        """The error: which unit ran on which ranks only, and what each rank was about to do."""
        skipped = [(self.units[i].label, [r for r, row in zip(ranks, ran) if row[i]],
                    [r for r, row in zip(ranks, ran) if not row[i]])
                   for i in range(len(self.units)) if 0 < sum(row[i] for row in ran) < len(ranks)]
        text = "; ".join(f"unit {label!r} ran its forward on {_who(on)} only: {_who(off)} skipped it"
                         for label, on, off in skipped) or "the ranks reached the units in different orders"
        sides = {}
        for rank, (code,) in zip(ranks, calls):
            sides.setdefault(code, []).append(rank)
        doing = ", ".join(f"{_who(members)} {KINDS[code % len(KINDS)]} unit {self.units[code // len(KINDS)].label!r}"
                          for code, members in sides.items())
        return (f"ZeRO-2/3, FSDP: {text} (at unit collective #{self.calls}: {doing}). Every rank must run every unit's "
                f"forward in every step (PyTorch's FSDP requires it too), else the ranks' collectives pair different "
                f"units' buffers. Run the unit on every rank, or leave its module out of the units (the root unit "
                f"then holds its parameters and reduces them once, at the end of the backward).")


def _who(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``tensor``, stacked (torch.distributed itself: not a call of minipar.comm)."""
    out = tensor.new_empty((dist.get_world_size(group) * len(tensor),))
    dist.all_gather_into_tensor(out, tensor, group=group)
    return out.view(-1, len(tensor))


def _ranks(group) -> list:
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)

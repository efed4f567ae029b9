"""The same stages trained by PyTorch's own pipeline runtime (``torch.distributed.pipelining``), to compare
minipar's schedules with: ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleGPipe``, and on the V
placement (rank r holds stages r and 2p-1-r, which both libraries compute) ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV``, whose overlapped F&B pairs (``OVERLAP_F_B``) are listed here as their two actions.

Besides the trained parameters, each rank reports PyTorch's schedule in minipar's terms: ``order``, the
compute actions of the schedule's own action lists (``pipeline_order``, idle slots dropped), and
``executed``, the forwards and backwards its stages really ran in the last step (recorded by wrapping the
stages' ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``), both as
:class:`~minipar.pipeline.schedules.Action`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..recipe import RunResult
from ..mesh import Mesh, RankMesh
from .schedules import Action, make_schedule
from .stages import assign, split_model, stage_loss

__all__ = ["torch_pipeline_train", "TORCH_SCHEDULES", "TorchPipelineRun"]

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb-v": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
KINDS = {"F": "F", "B": "BW", "I": "B", "W": "W"}      # torch's F, full backward, input grad, weight grad


@dataclass
class TorchPipelineRun(RunResult):
    """A :class:`RunResult` plus this rank's ``order`` (the schedule's list) and ``executed`` (last step)."""
    order: list = field(default_factory=list)
    executed: list = field(default_factory=list)


def _recorded(stage, log: list):
    """Wrap one ``PipelineStage`` so that every forward / backward it runs is appended to ``log``."""
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(chunk, *args, **kwargs):
        log.append(Action("F", stage.stage_index, chunk))
        return fwd(chunk, *args, **kwargs)

    def backward_one_chunk(chunk, *args, full_backward=True, **kwargs):
        log.append(Action("BW" if full_backward else "B", stage.stage_index, chunk))
        return bwd(chunk, *args, full_backward=full_backward, **kwargs)
    def backward_weight_one_chunk(chunk, *args, **kwargs):
        log.append(Action("W", stage.stage_index, chunk))
        return wgt(chunk, *args, **kwargs)
    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk
    return stage


def _flat(actions: list) -> list:
    """torch's actions with idle slots dropped and an overlapped F&B pair as its two sub-actions."""
    out = []
    for a in actions:
        if a is not None:
            out += list(a.sub_actions) if getattr(a, "sub_actions", None) else [a]
    return out


def torch_pipeline_train(rank: int, world_size: int, recipe, schedule: str = "1f1b", m: int = 4, v: int = 1,
                         mesh: RankMesh | None = None) -> TorchPipelineRun:
    """Train ``recipe`` with PyTorch's pipeline schedule on minipar's stages (round-robin for v > 1, the V
    for ``zb-v`` and ``dualpipev``)."""
    from torch.distributed import pipelining
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"no torch.distributed.pipelining counterpart for {schedule!r}; "
                         f"choose one of {sorted(TORCH_SCHEDULES)}")
    mesh = mesh or Mesh(world_size, pp=world_size).build(rank)
    p, pp_rank = mesh.size("pp"), mesh.coord("pp")
    all_stages = split_model(recipe.model().to(recipe.dtype), p * v)
    stages = assign(all_stages, p, pp_rank, make_schedule(schedule, p, m, v).placement)
    executed = []
    torch_stages = [_recorded(pipelining.PipelineStage(s, s.index, p * v, torch.device("cpu"),
                                                       group=mesh.group("pp")), executed)
                    for s in stages.values()]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    # scale_grads=True: gradients divided by m, i.e. the mean of the micro-batch mean losses
    sched = cls(torch_stages if v > 1 else torch_stages[0], n_microbatches=m, loss_fn=stage_loss,
                scale_grads=True)
    order = [Action(KINDS[a.computation_type.value], a.stage_index, a.microbatch_index)
             for a in _flat((getattr(sched, "pipeline_order", None) or {}).get(pp_rank, []))
             if a.computation_type.value in KINDS]
    params = [q for s in stages.values() for q in s.parameters()]
    opt = recipe.optimizer(params)
    holds_first = 0 in stages
    holds_last = p * v - 1 in stages
    losses = []
    for inputs, targets in recipe.batches:
        opt.zero_grad(set_to_none=True)
        executed.clear()
        mb_losses = []
        args = (inputs,) if holds_first else ()
        kwargs = {"target": targets, "losses": mb_losses} if holds_last else {}
        sched.step(*args, **kwargs)
        opt.step()
        if holds_last:
            losses.append(float(torch.stack(mb_losses).mean()))
    dist.barrier(mesh.group("pp"))
    reported = {n: t for s in stages.values() for n, t in s.reference_params().items()}
    return TorchPipelineRun(losses if holds_last else None, reported, order, list(executed))

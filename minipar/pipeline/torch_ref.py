"""The same stages trained by PyTorch's own pipeline runtime (``torch.distributed.pipelining``), to compare
minipar's schedules with: ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleGPipe``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..check import RunResult
from ..mesh import Mesh, RankMesh
from .stages import assign, split_model, stage_loss

__all__ = ["torch_pipeline_train", "TORCH_SCHEDULES"]

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


def torch_pipeline_train(rank: int, world_size: int, recipe, schedule: str = "1f1b", m: int = 4, v: int = 1,
                         mesh: RankMesh | None = None) -> RunResult:
    """Train ``recipe`` with PyTorch's pipeline schedule on minipar's stages (round-robin for v > 1)."""
    from torch.distributed import pipelining
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"no torch.distributed.pipelining counterpart for {schedule!r}; "
                         f"choose one of {sorted(TORCH_SCHEDULES)}")
    mesh = mesh or Mesh(world_size, pp=world_size).build(rank)
    p, pp_rank = mesh.size("pp"), mesh.coord("pp")
    stages = assign(split_model(recipe.model().to(recipe.dtype), p * v), p, pp_rank)
    torch_stages = [pipelining.PipelineStage(s, s.index, p * v, torch.device("cpu"), group=mesh.group("pp"))
                    for s in stages.values()]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    # scale_grads=True: gradients divided by m, i.e. the mean of the micro-batch mean losses
    sched = cls(torch_stages if v > 1 else torch_stages[0], n_microbatches=m, loss_fn=stage_loss,
                scale_grads=True)
    params = [q for s in stages.values() for q in s.parameters()]
    opt = recipe.optimizer(params)
    holds_first = 0 in stages
    holds_last = p * v - 1 in stages
    losses = []
    for inputs, targets in recipe.batches:
        opt.zero_grad(set_to_none=True)
        mb_losses = []
        args = (inputs,) if holds_first else ()
        kwargs = {"target": targets, "losses": mb_losses} if holds_last else {}
        sched.step(*args, **kwargs)
        opt.step()
        if holds_last:
            losses.append(float(torch.stack(mb_losses).mean()))
    dist.barrier(mesh.group("pp"))
    reported = {n: t for s in stages.values() for n, t in s.reference_params().items()}
    return RunResult(losses if holds_last else None, reported)

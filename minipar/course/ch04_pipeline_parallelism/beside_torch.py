"""Chapter 04's side-by-side with ``torch.distributed.pipelining``: one call per schedule, so the chapter's
cell shows the result (and asserts it) instead of the plumbing.

:func:`beside_torch` trains the recipe with PyTorch's schedule on minipar's stages (same cuts, same
placement: :func:`minipar.pipeline.torch_ref.torch_pipeline_train`), compares it with one device, and sets
what PyTorch really ran (``executed``, recorded per stage) and its own list (``pipeline_order``) beside
minipar's action lists, each played on minipar's simulator.
"""
from __future__ import annotations

from dataclasses import dataclass

from minipar.check import Comparison, compare
from minipar.launcher import launch
from minipar.pipeline.schedules import Schedule, make_schedule
from minipar.pipeline.simulate import SimResult, simulate
from minipar.pipeline.torch_ref import TORCH_SCHEDULES, torch_pipeline_train

from .figures import side_by_side

__all__ = ["Beside", "beside_torch"]


@dataclass
class Beside:
    """One schedule, PyTorch's run beside minipar's lists."""
    name: str
    torch_class: str
    comparison: Comparison          # PyTorch's training against one device
    executed_equal: bool            # what PyTorch ran == minipar's lists, on every rank
    order_equal: bool               # PyTorch's pipeline_order == minipar's lists, on every rank
    ours: SimResult
    theirs: SimResult               # PyTorch's executed lists on minipar's clock
    rank0: str                      # rank 0's lists aligned, '^' where they differ
    runs: list

    def __str__(self) -> str:
        return (f"{self.name} = {self.torch_class}: trains like one device ({self.comparison.max_abs_diff:.0e}); "
                f"executed lists equal ours on every rank: {self.executed_equal}; its pipeline_order too: "
                f"{self.order_equal}\n{self.rank0}\n  simulated: ours idle/total {self.ours.bubble_fraction:.1%}, "
                f"in flight {self.ours.peak_in_flight};  torch's {self.theirs.bubble_fraction:.1%}, "
                f"{self.theirs.peak_in_flight}")


def beside_torch(name: str, recipe, reference, p: int = 4, m: int = 8, v: int = 1) -> Beside:
    """Run PyTorch's counterpart of schedule ``name`` on ``p`` ranks and set it beside minipar's."""
    runs = launch(torch_pipeline_train, p, recipe, schedule=name, m=m, v=v, quiet=True)
    ours = make_schedule(name, p, m, v)
    executed = Schedule(f"torch {name}", p, m, v, [r.executed for r in runs], ours.placement, ours.overlapped)
    return Beside(name, TORCH_SCHEDULES[name], compare(reference, runs, dtype=recipe.dtype).assert_ok(),
                  executed.actions == ours.actions, [r.order for r in runs] == ours.actions,
                  simulate(ours), simulate(executed), side_by_side(ours.actions[0], executed.actions[0]), runs)

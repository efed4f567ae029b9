"""Chapter 03's FSDP in a plain training loop: ``FSDP(model)`` (:class:`minipar.data.fsdp.FSDP`, ZeRO-3 with one
unit per block plus the root, prefetch on) and an ordinary ``torch.optim`` optimizer over ``model.parameters()``,
which are this rank's flat shards (Zhao et al. 2023, PyTorch FSDP). The chapter prints :func:`train` and runs it
beside PyTorch's FSDP2 on the same units (:func:`run`: :func:`train_and_torch_fsdp2`, one launch, and one device)."""
from __future__ import annotations

from minipar.check import RunResult, train_reference
from minipar.data.fsdp import FSDP, torch_fsdp2_train
from minipar.launcher import launch
from minipar.loop import mean_over_ranks, shard_batch

from .figures import memory_recipe

__all__ = ["BLOCKS", "train", "train_and_torch_fsdp2", "run"]

# §3's GPT (h = 32, Adam, 2 steps) at 2 blocks, not its 8: equal to one device and to FSDP2 shows at 2 as at 8, and
# FSDP2's per-parameter DTensors cost time per block on every rank (this launch: 3.9 s at 8 blocks, 1.9 s at 2)
BLOCKS = 2


def train(rank, world_size, recipe):
    model = FSDP(recipe.model())                   # ZeRO-3: units = each block + the root
    opt = recipe.optimizer(model.parameters())     # this rank's shards: 1/N of every unit
    losses = []
    for inputs, targets in recipe.batches:
        loss = recipe.loss(model, *shard_batch((inputs, targets), rank, world_size))
        loss.backward()                            # gathers again, then reduce-scatters each unit
        opt.step()                                 # steps the shards only
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    return RunResult(losses, model.full_state_dict())


def train_and_torch_fsdp2(rank, world_size, recipe):
    """(:func:`train`'s result, PyTorch's ``fully_shard`` on the same units and batches), on the same ranks."""
    return train(rank, world_size, recipe), torch_fsdp2_train(rank, world_size, recipe)


def run(world_size: int) -> tuple:
    """(the ranks' :func:`train_and_torch_fsdp2`, one device's run) on §3's GPT at :data:`BLOCKS` blocks."""
    recipe = memory_recipe(n_layer=BLOCKS)
    return launch(train_and_torch_fsdp2, world_size, recipe, quiet=True), train_reference(recipe)

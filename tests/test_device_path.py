"""The 3D trainer follows its ``device``: checked on CPU, without a GPU.

On a GPU with NCCL every tensor that meets a collective or a parameter must be on the rank's GPU; a tensor
factory called without ``device=`` makes a CPU tensor, and NCCL (or the matmul with a CUDA weight) fails.
:class:`DeviceWatch` is a ``TorchFunctionMode`` that records every tensor factory (``torch.zeros``,
``torch.empty``, ``torch.tensor``, ``torch.arange``, ... : the functions ``with torch.device(...)`` redirects)
called without a ``device=`` keyword by code under ``minipar/``. The 3D trainer runs under it on real ranks
(2×2×2 with SP and ZeRO-1; pp = 2 with the interleaved schedule, v = 2; dropout on; a checkpoint saved and
loaded) and the list must be empty. Host-only tensors say ``device="cpu"``: explicit is the rule.
A second test shows the watch can fail: a device-less ``torch.zeros`` in a function whose code lives under
minipar/ is caught, with its file and line.

What this cannot see: a tensor that arrives from outside (the recipe's batches) and is not moved with
``.to(device)``; those moves are in :meth:`minipar.hybrid.parallel3d.Trainer3D.step` and the checkpoint's
``map_location``, read, not watched. Nothing here has run on a GPU.
"""
import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import minipar
from minipar.check import gpt_recipe
from minipar.hybrid.cli import train_rank
from minipar.hybrid.parallel3d import validate
from minipar.hybrid.runner import parallel_train
from minipar.launcher import launch

LIBRARY = os.path.dirname(os.path.abspath(minipar.__file__)) + os.sep
TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
ROOT = os.path.dirname(os.path.dirname(LIBRARY))


class DeviceWatch(TorchFunctionMode):
    """Records ``file:line`` of every tensor factory called without ``device=`` from code under minipar/ (the
    nearest caller outside torch and this file)."""

    def __init__(self):
        super().__init__()
        self.calls, self.factories = [], _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories and "device" not in kwargs:
            frame = sys._getframe(1)
            while frame is not None and (frame.f_code.co_filename.startswith(TORCH)
                                         or frame.f_code.co_filename == __file__):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(LIBRARY):
                where = os.path.relpath(frame.f_code.co_filename, ROOT)
                self.calls.append(f"{where}:{frame.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


def small_recipe(n_layer, steps=2):
    r = gpt_recipe(steps=steps, batch_size=8, seq_len=8, n_layer=n_layer, dropout=0.1)
    r.dtype = torch.float64
    return r


def watched_rank(rank, world_size, recipe, layout, folder):
    """Train, then train 1 step + save + resume + 1 step (the command's path), all under the watch."""
    with DeviceWatch() as watch:
        run = parallel_train(rank, world_size, recipe, device="cpu", **layout)
        train_rank(rank, world_size, recipe, layout=layout, steps=1, save=folder, err_fd=os.open(os.devnull, os.O_WRONLY))
        train_rank(rank, world_size, recipe, layout=layout, steps=2, resume=folder)
    assert all(t.device.type == "cpu" for t in run.params.values())
    return sorted(set(watch.calls))


LAYOUTS = {
    "2x2x2 sp zero1": dict(dp=2, pp=2, tp=2, sp=True, zero=1, micro_batches=2),
    "1x2x1 interleaved v=2": dict(dp=1, pp=2, tp=1, schedule="interleaved", v=2, micro_batches=2),
}
# Blocks per layout: one per stage (pp = 2) for 2x2x2, a block per model chunk (pp·v = 4) for the interleaved
# schedule; more blocks run the same code (and make the same factory calls) again: 8 ranks' CPU for nothing.
N_LAYER = {"2x2x2 sp zero1": 2, "1x2x1 interleaved v=2": 4}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_factory_in_the_3d_path_names_its_device(name, tmp_path):
    layout, recipe = LAYOUTS[name], small_recipe(N_LAYER[name])
    world = layout["dp"] * layout["pp"] * layout["tp"]
    validate(recipe, world_size=world, **layout)
    calls = launch(watched_rank, world, recipe, layout, str(tmp_path), quiet=True, timeout=120)
    found = sorted({c for rank_calls in calls for c in rank_calls})
    assert not found, "tensor factories without device= under minipar/:\n" + "\n".join(found)


def test_the_watch_catches_a_device_less_factory_in_library_code():
    path = os.path.join(LIBRARY, "hybrid", "parallel3d.py")
    code = compile("def make():\n    return torch.zeros(3)\n", path, "exec")
    scope = {"torch": torch}
    exec(code, scope)
    with DeviceWatch() as watch:
        scope["make"]()
        torch.zeros(3)                               # this file's call is not library code: not recorded
        torch.ones(2, device="cpu")                  # explicit: fine
    assert watch.calls == ["minipar/hybrid/parallel3d.py:2 torch.zeros"]


def test_train_command_with_spawned_ranks_prints_their_progress(monkeypatch, capfd):
    """``python -m minipar train --backend nccl`` spawns its ranks (CUDA forbids fork), and a spawned rank
    inherits no file descriptor but its own: its progress lines travel through files the command relays.
    Found on an H100 (2026-11-27): the command failed with ``OSError: [Errno 22]`` writing to the parent's
    duplicated stdout; under torchrun it ran. Here the spawn path runs with gloo (no GPU needed), on one rank:
    only the reporting rank writes progress, whatever the layout, and each spawned rank imports torch afresh
    (about 6 CPU-s with torch._dynamo); two spawned gloo ranks meeting are tests/test_launch.py's
    spawned_once, and a 2-rank command's lines test_train_command's."""
    import minipar.hybrid.cli as cli
    import minipar.launcher as launcher
    monkeypatch.setattr(launcher, "default_start_method", lambda backend: "spawn")
    assert cli.main(["--steps", "2", "--json", "--dtype", "float64"]) == 0
    out, err = capfd.readouterr()
    assert [line["step"] for line in map(__import__("json").loads, out.splitlines())] == [1, 2]
    assert "step    2/2" in err

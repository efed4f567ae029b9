"""A minipar checkpoint (saved at pp 2 × tp 2: TP pieces gathered, one file per stage) loads with
torch.distributed.checkpoint after ``python -m minipar export-dcp``: ``dcp.load`` fills a model's state dict with
the full parameters the ranks held, which are one device's after the same steps; ``dcp_to_torch_save`` gives
the same tensors and Adam's moments; a corrupt shard is refused before anything is written."""
import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from minipar import launch
from minipar.__main__ import main as minipar_main
from minipar.check import gpt_recipe, train_reference
from minipar.hybrid import checkpoint
from minipar.hybrid.dcp_export import load_dcp_model
from minipar.hybrid.parallel3d import Trainer3D


def recipe():
    r = gpt_recipe(steps=2, batch_size=4, seq_len=8, n_layer=2)
    r.dtype = torch.float64
    return r


def save_rank(rank, world_size, recipe, directory):
    t = Trainer3D(rank, world_size, recipe, dp=1, pp=2, tp=2, micro_batches=2)
    for i in range(recipe.steps):
        t.step(*recipe.batches[i], i)
    checkpoint.save(t, directory, recipe.steps)
    return t.full_params()


def test_a_minipar_checkpoint_loads_with_dcp(tmp_path, capsys):
    saved = str(tmp_path / "ckpt")
    held = {}
    for params in launch(save_rank, 4, recipe(), saved, quiet=True):
        held.update(params)
    out = str(tmp_path / "dcp")
    assert minipar_main(["export-dcp", saved, out]) == 0
    assert os.path.exists(os.path.join(out, ".metadata"))
    model = recipe().model().to(torch.float64)
    assert load_dcp_model(out, model) == 2
    loaded = dict(model.named_parameters())
    assert loaded.keys() == held.keys()
    for name, p in loaded.items():
        assert torch.equal(p.detach(), held[name]), name                   # every element, as the ranks held it
    ref = train_reference(recipe()).params
    for name, p in loaded.items():
        torch.testing.assert_close(p.detach(), ref[name], rtol=1e-10, atol=1e-12)
    dcp_to_torch_save(out, str(tmp_path / "one.pt"))
    one = torch.load(str(tmp_path / "one.pt"), weights_only=True)
    assert one["step"] == 2 and one["optim"]["step"] == 2.0
    assert set(one["optim"]["exp_avg"]) == set(held) and all(torch.equal(one["model"][n], held[n]) for n in held)
    folder = checkpoint.latest(saved)                                      # a corrupt shard: refused
    with open(os.path.join(folder, "stage-1.pt"), "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xfe")
    with pytest.raises(checkpoint.CheckpointError, match="stage-1.pt"):
        minipar_main(["export-dcp", saved, str(tmp_path / "bad")])
    assert not os.path.exists(str(tmp_path / "bad"))

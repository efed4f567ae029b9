"""Asynchronous checkpoints (minipar.hybrid.async_checkpoint): the next step starts before the file is closed
(the trace), the checkpoint written in the background equals the synchronous one file for file, a SIGKILL
during the background write (while the next step trains) leaves the previous checkpoint as ``latest`` and the
restart from it equals the run that never stopped; ``train --async-checkpoint`` saves the same state."""
import functools
import os
import time

import pytest
import torch

from minipar import launch
from minipar.check import gpt_recipe
from minipar.hybrid import checkpoint
from minipar.hybrid.async_checkpoint import AsyncCheckpointer, overlaps, save_timeline
from minipar.hybrid.cli import main as train_main
from minipar.hybrid.parallel3d import Trainer3D
from minipar.launcher import RankError

LAYOUT = dict(dp=1, pp=2, tp=1, micro_batches=2)        # two ranks, each writes its own stage file


def recipe(steps=4):
    r = gpt_recipe(steps=steps, batch_size=4, seq_len=8, n_layer=2)
    r.dtype = torch.float64
    return r


def slow(step, *, at, seconds):
    if step == at:
        time.sleep(seconds)


def async_rank(rank, world_size, recipe, directory, steps, slow_at=None, crash_rank=None):
    """Train ``steps`` steps, an asynchronous save after each; the save of step ``slow_at`` writes slowly."""
    t = Trainer3D(rank, world_size, recipe, **LAYOUT)
    hook = functools.partial(slow, at=slow_at, seconds=0.4) if slow_at else None
    saver = AsyncCheckpointer(t, directory, before_write=hook)
    for i in range(steps):
        saver.step_started(i)
        t.step(*recipe.batches[i], i)
        if crash_rank is not None and i + 1 == slow_at:
            saver.crash_rank = crash_rank                   # only this save's writer dies
        saver.save(i + 1)
    saver.finish()
    return saver.events, t.full_params()


def sync_rank(rank, world_size, recipe, directory, steps, start_from=None):
    t = Trainer3D(rank, world_size, recipe, **LAYOUT)
    start = checkpoint.load(t, start_from) if start_from else 0
    for i in range(start, steps):
        t.step(*recipe.batches[i], i)
    checkpoint.save(t, directory, steps)
    return start, t.full_params()


def shard_tensors(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("stage-"):
            out[name] = torch.load(os.path.join(folder, name), weights_only=True)
    return out


def assert_same_files(a, b):
    fa, fb = shard_tensors(a), shard_tensors(b)
    assert fa.keys() == fb.keys() and fa
    for name in fa:
        for kind in ("params", "optimizer"):
            flat_a = fa[name][kind] if kind == "params" else {(k, n): v for k, d in fa[name][kind].items() for n, v in d.items()}
            flat_b = fb[name][kind] if kind == "params" else {(k, n): v for k, d in fb[name][kind].items() for n, v in d.items()}
            assert flat_a.keys() == flat_b.keys() and flat_a, (name, kind)
            for key in flat_a:
                assert torch.equal(flat_a[key], flat_b[key]), (name, key)


def test_the_next_step_starts_before_the_background_write_closes(tmp_path):
    events, _ = launch(async_rank, 2, recipe(3), str(tmp_path / "async"), 3, slow_at=2, quiet=True)[0]
    rows = {r["step"]: r for r in save_timeline(events)}
    assert 2 in overlaps(events)                             # the slowed write ran beside step 3
    row = rows[2]
    assert row["snapshot"][1] <= row["next_step_start"] < row["write"][1]
    assert row["write"][1] - row["write"][0] >= 0.4          # the slow write really took its time
    # the state the background wrote is the synchronous save's, file for file
    launch(sync_rank, 2, recipe(3), str(tmp_path / "sync"), 3, quiet=True)
    assert_same_files(checkpoint.latest(str(tmp_path / "async")), checkpoint.latest(str(tmp_path / "sync")))
    folder = checkpoint.latest(str(tmp_path / "async"))
    checkpoint.verify(folder, checkpoint.read_manifest(folder))


@pytest.mark.serial
def test_a_kill_during_the_background_write_resumes_like_a_synchronous_save(tmp_path):
    d = str(tmp_path / "ckpt")
    with pytest.raises(RankError, match="rank 1"):          # rank 1 dies mid-write of step 2, training step 3
        launch(async_rank, 2, recipe(), d, 4, slow_at=2, crash_rank=1, quiet=True)
    assert checkpoint.latest(d).endswith("step-00000001")   # the write in flight is named by nothing
    assert os.path.isdir(os.path.join(d, "step-00000002.partial"))
    resumed = launch(sync_rank, 2, recipe(), str(tmp_path / "resumed"), 4, start_from=d, quiet=True)
    straight = launch(sync_rank, 2, recipe(), str(tmp_path / "straight"), 4, quiet=True)
    assert [s for s, _ in resumed] == [1, 1]
    for (_, got), (_, want) in zip(resumed, straight):
        assert got.keys() == want.keys() and got
        for name in got:
            assert torch.equal(got[name], want[name]), name


def test_train_async_checkpoint_saves_what_a_synchronous_run_saves(tmp_path, capfd):
    flags = ["--pp", "2", "--micro-batches", "2", "--steps", "3", "--n-layer", "2", "--batch-size", "4",
             "--seq-len", "8", "--dtype", "float64", "--save-every", "1"]
    assert train_main(flags + ["--save", str(tmp_path / "a"), "--async-checkpoint"]) == 0
    assert train_main(flags + ["--save", str(tmp_path / "s")]) == 0
    a, s = checkpoint.latest(str(tmp_path / "a")), checkpoint.latest(str(tmp_path / "s"))
    assert a.endswith("step-00000003")
    assert_same_files(a, s)
    assert "saved step 3" in capfd.readouterr().err
    with pytest.raises(SystemExit) as exit_:                    # nothing to write: refused before launch
        train_main(flags[:-2] + ["--async-checkpoint"])
    assert exit_.value.code == 2 and "give --save DIR" in capfd.readouterr().err

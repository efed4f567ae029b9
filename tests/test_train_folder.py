"""The ``--save`` folder of ``python -m minipar train`` (issue 38): a run owns it while it writes (a lock naming
its pid and host; a second run on it is refused with one line before training, and its first run's checkpoints
stay intact; a dead run's lock is taken over), ``--keep N`` removes all but the newest N checkpoints and never the
one ``latest`` names, a full disk names the file and the checkpoint ``latest`` still names, and
``--wait-for-lock SECONDS`` waits for a holder to finish instead of refusing at once."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from minipar import launch
from minipar.check import gpt_recipe
from minipar.hybrid import checkpoint, guard
from minipar.hybrid.cli import main
from minipar.hybrid.parallel3d import Trainer3D
from minipar.launcher import RankError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--batch-size", "8", "--seq-len", "8", "--micro-batches", "2", "--dtype", "float64", "--n-layer", "2"]


def refused(capsys, *flags) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(list(flags))
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def _steps_in(folder) -> list:
    return sorted(n for n in os.listdir(folder) if n.startswith("step-"))


def test_a_second_run_on_a_folder_in_use_is_refused_and_the_first_finishes_intact(capsys, tmp_path):
    folder = str(tmp_path / "run")
    # 16 steps: 15 still to go (each saved) when the second run is refused, in this process, at once
    same = ["--steps", "16", *SMALL, "--save-every", "1", "--resume", folder, "--save", folder]
    first = subprocess.Popen([sys.executable, "-m", "minipar", "train", *same], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    for line in first.stderr:                              # the first run has saved once: the folder is in use
        if "saved step 1 " in line:
            break
    err = refused(capsys, *same)                           # the same command line, launched twice
    assert f"--save {folder} is in use by pid {first.pid} on host {socket.gethostname()}" in err, err
    _, rest = first.communicate(timeout=300)
    assert first.returncode == 0, rest[-2000:]
    done = checkpoint.latest(folder)
    manifest = checkpoint.read_manifest(done)
    checkpoint.verify(done, manifest)                      # every file of the first run's last save is whole
    assert manifest["step"] == 16
    assert _steps_in(folder) == ["step-00000014", "step-00000015", "step-00000016"]   # --keep 3, the default
    assert not os.path.exists(os.path.join(folder, guard.LOCK))                       # released at the end


def test_the_lock_names_a_live_holder_and_a_dead_ones_is_taken_over(capsys, monkeypatch, tmp_path):
    folder = str(tmp_path / "run")
    os.makedirs(folder)
    lock = os.path.join(folder, guard.LOCK)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(lock, "w") as f:
            json.dump({"pid": holder.pid, "host": socket.gethostname(), "since": "then"}, f)
        err = refused(capsys, "--steps", "2", *SMALL, "--save", folder, "--overwrite")   # --overwrite: still no
        assert f"in use by pid {holder.pid}" in err and "remove" in err and lock in err
        with open(lock, "w") as f:                          # another host: it cannot be asked, so it holds
            json.dump({"pid": 1, "host": "elsewhere"}, f)
        assert "on host elsewhere" in refused(capsys, "--steps", "2", *SMALL, "--save", folder)
    finally:
        holder.kill()
        holder.wait()
    with open(lock, "w") as f:                              # the holder is dead now: its lock is stale
        json.dump({"pid": holder.pid, "host": socket.gethostname()}, f)
    seen = []

    def fake_launch(*args, **kwargs):                       # during the run, the lock is this process's
        with open(lock) as f:
            seen.append(json.load(f)["pid"])
    monkeypatch.setattr("minipar.launcher.launch", fake_launch)
    assert main(["--steps", "2", *SMALL, "--save", folder]) == 0
    assert seen == [os.getpid()] and not os.path.exists(lock)


def test_refused_after_taking_the_lock_releases_it(capsys, tmp_path):
    folder = str(tmp_path / "run")
    assert "unrecognized" not in refused(capsys, "--steps", "2", *SMALL, "--save", folder, "--resume",
                                         str(tmp_path / "nowhere" / "x"))
    assert os.path.isdir(folder) and not os.path.exists(os.path.join(folder, guard.LOCK))


def _save_steps(rank, world_size, targets, fail_at=None):
    """Train 6 steps, saving each into every (directory, keep) of ``targets``; the last complete checkpoint of
    each. One training saves into several folders: the saves only read the trainer."""
    rec = gpt_recipe(steps=6, batch_size=8, seq_len=8, n_layer=2)
    rec.dtype = torch.float64
    trainer = Trainer3D(rank, world_size, rec, dp=1, pp=2, tp=1, micro_batches=2)
    for step in range(6):
        trainer.step(*rec.batches[step], step)
        if step + 1 == fail_at:
            real = torch.save

            def full_disk(obj, path, *a, **k):              # what torch says when the disk fills mid-file
                if os.path.basename(str(path)).startswith("stage-1"):
                    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 1024")
                return real(obj, path, *a, **k)
            torch.save = full_disk
        for directory, keep in targets:
            checkpoint.save(trainer, directory, step + 1, keep=keep)
    return [checkpoint.latest(directory) for directory, _ in targets]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One launch for the two --keep tests: folders "k2" (--keep 2), "all" (--keep 0, every step kept) and
    "ckpt" (another run's checkpoints 38-40 there first, latest at 40; then what --overwrite --keep 2 saves)."""
    root = tmp_path_factory.mktemp("keep")
    for step in (38, 39, 40):
        (root / "ckpt" / f"step-{step:08d}").mkdir(parents=True)
    (root / "ckpt" / "latest").write_text("step-00000040")
    launch(_save_steps, 2, [(str(root / "k2"), 2), (str(root / "all"), 0), (str(root / "ckpt"), 2)], quiet=True)
    return root


def test_keep_holds_and_never_removes_what_latest_names(saved):
    assert _steps_in(saved / "k2") == ["step-00000005", "step-00000006"]
    assert len(_steps_in(saved / "all")) == 6
    folder = saved / "all"
    os.replace(folder / "latest", folder / "latest.old")
    (folder / "latest").write_text("step-00000003")         # as if --overwrite had saved step 3 over steps 1-6:
    assert checkpoint.prune(str(folder), 2) == [f"step-0000000{i}" for i in (1, 4, 5, 6)]   # 4-6 are replaced
    assert _steps_in(folder) == ["step-00000002", "step-00000003"]


def test_keep_after_overwrite_keeps_the_new_runs_newest_not_the_replaced_runs(saved):
    folder = saved / "ckpt"             # another run's checkpoints 38-40, then --overwrite --keep 2 saved steps 1-6
    assert _steps_in(folder) == ["step-00000005", "step-00000006"]       # (it kept 38-40 and pruned 1-5)
    assert checkpoint.latest(str(folder)).endswith("step-00000006")


def test_a_full_disk_names_the_file_and_what_latest_still_names(tmp_path):
    directory = str(tmp_path / "ckpt")
    with pytest.raises(RankError) as info:
        launch(_save_steps, 2, [(directory, 3)], fail_at=4, quiet=True)
    message = str(info.value).splitlines()[0]
    assert "cannot write " + os.path.join(directory, "step-00000004.partial", "stage-1.pt") in message, message
    assert "the disk (or the file-size limit) is full (" in message and "unexpected pos" in message
    assert f"{directory}/latest still names step-00000003, the last complete checkpoint" in message
    done = checkpoint.latest(directory)
    assert done.endswith("step-00000003")
    checkpoint.verify(done, checkpoint.read_manifest(done))


def test_other_write_errors_pass_through_and_enospc_is_explained(tmp_path):
    other = PermissionError(13, "Permission denied")
    assert guard.write_failed(other, "f", str(tmp_path)) is other
    explained = guard.write_failed(OSError(28, "No space left on device"), "f.pt", str(tmp_path))
    assert isinstance(explained, guard.CheckpointError)
    assert "cannot write f.pt" in str(explained) and "holds no complete checkpoint yet" in str(explained)


def test_wait_for_lock_takes_the_folder_when_its_holder_ends_and_refuses_after_the_wait(tmp_path):
    folder = str(tmp_path)
    lock = os.path.join(folder, guard.LOCK)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    threading.Thread(target=holder.wait).start()           # reaped when it ends (a zombie's pid looks alive)
    with open(lock, "w") as f:                              # a live run holds it for 1.5 s, then dies
        json.dump({"pid": holder.pid, "host": socket.gethostname()}, f)
    with pytest.raises(checkpoint.CheckpointError, match=f"in use by pid {holder.pid}.*--wait-for-lock"):
        guard.lock_folder(folder, wait=0.3)                 # waited 0.3 s: still held
    assert guard.lock_folder(folder, wait=30) == lock       # waits for it, then takes the dead run's lock
    with open(lock) as f:
        assert json.load(f)["pid"] == os.getpid()
    guard.unlock_folder(lock)


@pytest.mark.parametrize("content", ["", "{\"pi", "[1, 2]", "{\"host\": \"x\"}"],
                         ids=["empty", "cut", "list", "no pid"])
def test_an_empty_or_garbage_lock_is_taken_over_once_it_stays_unreadable(tmp_path, content):
    lock = os.path.join(tmp_path, guard.LOCK)
    with open(lock, "w") as f:                              # a killed writer's, or a hand-made, lock
        f.write(content)
    old = os.path.getmtime(lock) - 2 * guard.UNREADABLE_LOCK_SECONDS
    os.utime(lock, (old, old))
    assert guard.lock_folder(str(tmp_path)) == lock         # it blocked the folder until removed by hand
    with open(lock) as f:
        assert json.load(f)["pid"] == os.getpid()
    guard.unlock_folder(lock)
    assert not os.path.exists(lock)


def test_a_fresh_unreadable_lock_is_waited_for_then_taken(tmp_path):
    lock = os.path.join(tmp_path, guard.LOCK)
    open(lock, "w").close()                                 # a run may be writing it this instant
    assert guard.lock_folder(str(tmp_path)) == lock         # wait 0: still waits out the grace, then takes it
    assert time.time() - os.path.getmtime(lock) < 1 and guard.process_start(os.getpid()) is not None
    guard.unlock_folder(lock)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc for a process's start time")
def test_a_reused_pid_is_not_taken_for_the_holder(tmp_path):
    lock = os.path.join(tmp_path, guard.LOCK)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])   # alive, another program
    try:
        started = guard.process_start(other.pid)
        with open(lock, "w") as f:                          # its pid, its start time: the holder, refused
            json.dump({"pid": other.pid, "started": started, "host": socket.gethostname()}, f)
        with pytest.raises(checkpoint.CheckpointError, match=f"in use by pid {other.pid}"):
            guard.lock_folder(str(tmp_path))
        with open(lock, "w") as f:                          # its pid, an earlier process's start time: stale
            json.dump({"pid": other.pid, "started": str(int(started) - 1), "host": socket.gethostname()}, f)
        assert guard.lock_folder(str(tmp_path)) == lock
        with open(lock) as f:
            assert json.load(f) | {"since": None} == {"pid": os.getpid(), "started": guard.process_start(os.getpid()),
                                                      "host": socket.gethostname(), "since": None}
    finally:
        other.kill()
        other.wait()
    guard.unlock_folder(lock)

"""``python -m minipar train``: --json lines, --save/--resume equal to an uninterrupted run, the single-device
layout, clear errors with exit code 2, and the same command under torchrun; the backend and device choice
(auto: NCCL on one GPU per rank where CUDA is, else gloo on the CPU), tested without a GPU."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from minipar.hybrid.cli import main
from minipar.launcher import choose_backend_and_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--batch-size", "8", "--seq-len", "8", "--micro-batches", "2", "--dtype", "float64"]


def train(capfd, *flags):
    capfd.readouterr()
    assert main([*flags, *SMALL, "--json"]) == 0
    out, err = capfd.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    return {d["step"]: d["loss"] for d in lines}, err


def train_under_torchrun_as_two_nodes(nproc_per_node: int, *flags, timeout: int = 600) -> tuple:
    """``torchrun --nnodes 2 --nproc_per_node N --node_rank i ... -m minipar train *flags --json`` on localhost: two
    agents of N processes each (LOCAL_WORLD_SIZE = N, WORLD_SIZE = 2N): ({step: loss}, both agents' stderr)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = str(free_port())
    agents = [subprocess.Popen([torchrun, "--nnodes", "2", f"--nproc_per_node={nproc_per_node}", "--node_rank",
                                str(node), "--master_addr", "127.0.0.1", "--master_port", port, "-m", "minipar",
                                "train", *flags, "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
              for node in (0, 1)]
    outs = [a.communicate(timeout=timeout) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    lines = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    return {d["step"]: d["loss"] for d in lines}, outs[0][1] + outs[1][1]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ONE_PROCESS = {}


def one_process(capfd) -> dict:
    """The command's single-device losses of steps 1..3 (``--dp 1 --pp 1 --tp 1 --micro-batches 1``), run once per
    module: every test here that compares a layout with one process compares with this run (a 2-step run's losses
    are its first two: the batches and Adam do not depend on the step count)."""
    if not _ONE_PROCESS:
        _ONE_PROCESS.update(train(capfd, "--dp", "1", "--pp", "1", "--tp", "1", "--steps", "3",
                                  "--micro-batches", "1")[0])
    assert list(_ONE_PROCESS) == [1, 2, 3]
    return dict(_ONE_PROCESS)


PP2_TP2 = ["--dp", "1", "--pp", "2", "--tp", "2"]
KILLED_STEPS = 16                   # the killed-rank test's run: killed after step 3, 13 steps still to go when it dies
_UNINTERRUPTED = {}


def uninterrupted_pp2_tp2(capfd, tmp_path_factory) -> tuple:
    """``--dp 1 --pp 2 --tp 2``, KILLED_STEPS steps, saved at the end, once per module: ({step: loss}, its --save
    folder). The killed-rank test's uninterrupted result (losses, parameters and Adam moments), and the save/resume
    test's straight run (its first 4 losses: a step's batch and Adam's update do not depend on the step count):
    one launch of 4 ranks, not two."""
    if not _UNINTERRUPTED:
        folder = str(tmp_path_factory.mktemp("straight"))
        _UNINTERRUPTED["run"] = json_losses(capfd, *PP2_TP2, "--steps", str(KILLED_STEPS), *SMALL, "--json",
                                            "--save", folder), folder
    losses, folder = _UNINTERRUPTED["run"]
    assert list(losses) == list(range(1, KILLED_STEPS + 1))
    return dict(losses), folder


def test_save_then_resume_equals_uninterrupted(capfd, tmp_path, tmp_path_factory):
    layout = PP2_TP2
    first, err = train(capfd, *layout, "--steps", "2", "--save", str(tmp_path))
    assert list(first) == [1, 2] and "tokens/s" in err and "saved step 2" in err
    resumed, _ = train(capfd, *layout, "--steps", "4", "--resume", str(tmp_path))
    straight = uninterrupted_pp2_tp2(capfd, tmp_path_factory)[0]       # its steps 1..4: what --steps 4 gives
    assert list(resumed) == [3, 4]
    assert resumed == {s: straight[s] for s in (3, 4)}          # bit for bit: same layout, same arithmetic
    assert first == {s: straight[s] for s in (1, 2)}


def test_three_d_equals_one_device_from_the_shell(capfd):
    one = one_process(capfd)
    three_d, _ = train(capfd, "--dp", "2", "--pp", "2", "--tp", "2", "--steps", "2")
    assert list(three_d) == [1, 2]
    for s in three_d:
        assert three_d[s] == pytest.approx(one[s], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("zero", ["2", "3"])
def test_zero_2_and_3_with_a_pipeline_equal_one_process_and_resume(capfd, tmp_path, zero):
    """Issue 39: ZeRO-2/3 inside a 2-stage pipeline (gathered and reduced once per step) trains as one process
    does, and a checkpoint saved from it resumes bit for bit (ZeRO-3's freed parameters gathered to save)."""
    one = one_process(capfd)
    layout = ["--dp", "2", "--pp", "2", "--tp", "1", "--zero", zero]
    first, _ = train(capfd, *layout, "--steps", "2", "--save", str(tmp_path))
    resumed, _ = train(capfd, *layout, "--steps", "3", "--resume", str(tmp_path))
    straight, _ = train(capfd, *layout, "--steps", "3")
    for s in one:
        assert straight[s] == pytest.approx(one[s], rel=1e-12, abs=1e-12)
    assert first == {s: straight[s] for s in (1, 2)} and resumed == {3: straight[3]}


@pytest.mark.parametrize("flags, words", [
    (["--dp", "1", "--pp", "1", "--tp", "3"], "not divisible by the tensor-parallel degree 3"),
    (["--dp", "1", "--pp", "8", "--tp", "1", "--micro-batches", "8"], "cannot be cut into"),
    (["--dp", "2", "--pp", "2", "--tp", "2", "--schedule", "zb-h1"], "invalid choice"),
    (["--dp", "two"], "invalid int value"),
    (["--dp", "1", "--resume", "/nonexistent/dir"], "latest is missing"),
])
def test_bad_flags_exit_2(capsys, flags, words):
    with pytest.raises(SystemExit) as info:
        main(flags)
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_exit_code_from_the_shell():
    done = subprocess.run([sys.executable, "-m", "minipar", "train", "--tp", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "tensor-parallel degree 3" in done.stderr


# The command under torchrun equals it on local ranks bit for bit: test_sixteen_moe_ranks_under_torchrun_then_resume_
# at_ep_4 asserts it of the 16-rank run (pp 2 among its dimensions), so no 2-rank torchrun run of its own here.


@pytest.mark.parametrize("requested, cuda, count, local_rank, want", [
    ("auto", False, 0, 0, ("gloo", "cpu")),
    ("auto", False, 0, 3, ("gloo", "cpu")),
    ("auto", True, 8, 0, ("nccl", "cuda:0")),
    ("auto", True, 8, 5, ("nccl", "cuda:5")),
    ("auto", True, 4, 6, ("nccl", "cuda:2")),        # LOCAL_RANK beyond the GPUs wraps around
    ("gloo", True, 8, 5, ("gloo", "cpu")),           # gloo stays on the CPU even where GPUs exist
    ("gloo", False, 0, 1, ("gloo", "cpu")),
    ("nccl", True, 2, 1, ("nccl", "cuda:1")),
])
def test_choose_backend_and_device(requested, cuda, count, local_rank, want):
    assert choose_backend_and_device(requested, local_rank=local_rank, cuda_available=cuda,
                                     device_count=count) == want


@pytest.mark.parametrize("requested, words", [("nccl", "needs CUDA"), ("mpi", "'auto', 'gloo' or 'nccl'")])
def test_choose_backend_and_device_refuses(requested, words):
    with pytest.raises(ValueError, match=words):
        choose_backend_and_device(requested, local_rank=0, cuda_available=False, device_count=0)


def no_launch(*args, **kwargs):
    pytest.fail("a process was started")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: NCCL is allowed")
def test_nccl_without_a_gpu_exits_2(capsys, monkeypatch):
    monkeypatch.setattr("minipar.launcher.launch", no_launch)
    with pytest.raises(SystemExit) as info:
        main(["--backend", "nccl", "--steps", "1"])
    assert info.value.code == 2
    assert "CUDA" in capsys.readouterr().err


def test_nccl_with_more_local_ranks_than_gpus_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)      # pretend: one GPU, two ranks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("minipar.launcher.launch", no_launch)
    with pytest.raises(SystemExit) as info:
        main(["--backend", "auto", "--pp", "2", "--steps", "1", *SMALL])
    assert info.value.code == 2
    assert "2 ranks but 1 GPU(s)" in capsys.readouterr().err


def test_auto_backend_runs_on_gloo_here(capfd, monkeypatch):
    from minipar.launcher import launch
    started = []

    def spy(*args, **kwargs):
        started.append(kwargs["backend"])
        return launch(*args, **kwargs)
    monkeypatch.setattr("minipar.launcher.launch", spy)
    losses, err = train(capfd, "--backend", "auto", "--pp", "2", "--steps", "1")
    assert started == ["nccl" if torch.cuda.device_count() >= 2 else "gloo"] and list(losses) == [1]


# ------------------------------------------------------------------------------------------------------
# What real runs meet (issue 30): bad flags, refused resumes and saves, restarts, nodes, signals
# ------------------------------------------------------------------------------------------------------

def refused(capsys, monkeypatch, *flags):
    """Run the command with ``flags``; it must exit 2 with one line on stderr and start no process."""
    monkeypatch.setattr("minipar.launcher.launch", no_launch)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(list(flags))
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("flags, words", [
    (["--seq-len", "0"], "--seq-len must be a positive integer, got 0"),
    (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["--batch-size", "-4"], "--batch-size must be a positive integer, got -4"),
    (["--n-head", "0"], "--n-head must be a positive integer"),
    (["--n-layer", "0"], "--n-layer must be a positive integer"),
    (["--n-embd", "30"], "--n-embd 30 is not divisible by --n-head 4"),
    (["--seq-len", "4096"], "fit at most 4094"),
    (["--timeout", "0"], "--timeout must be a positive number"),
    (["--timeout", "-1"], "--timeout must be a positive number"),
    (["--timeout", "nan"], "got nan"),
    (["--timeout", "inf"], "got inf"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--micro-batches", "0"], "--micro-batches must be a positive integer"),
    (["--virtual-stages", "0"], "--virtual-stages must be a positive integer"),
    (["--save-every", "0", "--save", "x"], "--save-every must be a positive integer"),
    (["--save-every", "2"], "--save-every needs --save"),
    (["--keep", "2"], "--keep needs --save DIR"),                          # each changes nothing without it
    (["--keep", "0"], "--keep needs --save DIR"),
    (["--wait-for-lock", "5"], "--wait-for-lock needs --save DIR"),
    (["--overwrite"], "--overwrite needs --save DIR"),
    (["--wait-for-lock", "inf", "--save", "x"], "--wait-for-lock must be a finite number of seconds >= 0, got inf"),
    (["--wait-for-lock", "nan", "--save", "x"], "got nan"),
    (["--wait-for-lock", "-1", "--save", "x"], "got -1.0"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be a positive integer"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--tp", "3"], "tensor-parallel degree 3"),
    (["--step", "4"], "unrecognized arguments: --step 4"),               # no abbreviations (allow_abbrev)
    (["--keep", "-1", "--save", "x"], "--keep must be >= 0"),
    (["--sp"], "--sp splits the sequence over the tp group, and --tp 1 has none"),
    (["--zero", "4"], "invalid choice: 4"),
    (["--shared-experts", "1"], "--shared-experts needs an MoE model (--experts > 0)"),
    (["--granularity", "2"], "--granularity needs an MoE model (--experts > 0)"),
    (["--bias-rate", "1e-3"], "--bias-rate needs an MoE model (--experts > 0)"),
    (["--experts", "4", "--shared-experts", "-1"], "--shared-experts must be >= 0, got -1"),
    (["--experts", "4", "--granularity", "0"], "--granularity must be a positive integer, got 0"),
    (["--experts", "4", "--granularity", "3"], "granularity 3 must divide ffn_mult=4"),
    (["--experts", "4", "--bias-rate", "-1"], "--bias-rate must be a finite number >= 0 (0: off), got -1.0"),
    (["--experts", "4", "--bias-rate", "nan"], "got nan"),
    (["--experts", "4", "--bias-rate", "1e-3"], "--bias-rate with --micro-batches 8: loss-free balancing moves its "
                                                "bias from one forward's load"),
    (["--experts", "4", "--bias-rate", "1e-3", "--micro-batches", "1", "--save", "x"],
     "--bias-rate with --save: loss-free balancing's routing biases are not saved in a checkpoint yet"),
    (["--experts", "4", "--bias-rate", "1e-3", "--micro-batches", "1", "--resume", "x"],
     "--bias-rate with --resume: loss-free balancing's routing biases are not saved in a checkpoint yet"),
])
def test_every_flag_is_checked_before_any_process_starts(capsys, monkeypatch, flags, words):
    assert words in refused(capsys, monkeypatch, *flags)


@pytest.fixture(scope="module")
def checkpoint_at_2(tmp_path_factory):
    """A checkpoint of the 4-layer model, seed 0, float64, after 2 steps on one process."""
    folder = str(tmp_path_factory.mktemp("ckpt"))
    assert main(["--steps", "2", "--micro-batches", "1", "--save", folder, *SMALL[:4], "--dtype", "float64"]) == 0
    return folder


@pytest.mark.parametrize("flags, words", [
    (["--n-layer", "2"], "config.n_layer: checkpoint 4, this run 2"),
    (["--n-head", "2"], "config.n_head: checkpoint 4, this run 2"),
    (["--seed", "1"], "seed: checkpoint 0, this run 1"),
    (["--dtype", "float32"], "dtype: checkpoint 'float64', this run 'float32'"),
    (["--batch-size", "4"], "data.batch_size: checkpoint 8, this run 4"),
    (["--n-layer", "2", "--seed", "3"], "config.n_layer: checkpoint 4, this run 2; seed: checkpoint 0, this run 3"),
])
def test_a_resume_into_another_run_is_refused_with_the_differences(capsys, monkeypatch, checkpoint_at_2, flags,
                                                                   words):
    base = ["--steps", "4", "--micro-batches", "1", *SMALL[:4], "--dtype", "float64"]
    err = refused(capsys, monkeypatch, *base, *flags, "--resume", checkpoint_at_2)
    assert "its checkpoint is of another run" in err and words in err


def test_saves_that_cannot_work_or_would_replace_are_refused(capsys, monkeypatch, checkpoint_at_2, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    base = ["--steps", "3", "--micro-batches", "1", *SMALL[:4], "--dtype", "float64"]
    for where in (str(a_file), str(a_file / "under"), "/proc/minipar-checkpoint"):
        assert "cannot save into" in refused(capsys, monkeypatch, *base, "--save", where)
    err = refused(capsys, monkeypatch, *base, "--n-layer", "2", "--save", checkpoint_at_2)
    assert "holds another run's checkpoint (config.n_layer: checkpoint 4, this run 2" in err
    err = refused(capsys, monkeypatch, *base, "--steps", "1", "--save", checkpoint_at_2)    # latest 2 -> 1
    assert "holds step 2, later than this run's start (step 0)" in err and "--overwrite" in err
    started = []
    monkeypatch.setattr("minipar.launcher.launch", lambda *a, **k: started.append(k["save"]))
    assert main([*base, "--steps", "1", "--save", checkpoint_at_2, "--overwrite"]) == 0    # asked for: allowed
    assert main([*base, "--resume", checkpoint_at_2, "--save", checkpoint_at_2]) == 0     # continuing: allowed
    assert started == [checkpoint_at_2] * 2


def test_resume_from_an_empty_folder_starts_fresh_then_continues(capfd, tmp_path):
    folder = str(tmp_path / "run")                  # does not exist yet: --save creates it
    same = ["--dp", "1", "--pp", "2", "--tp", "1", "--resume", folder, "--save", folder, "--save-every", "1"]
    first, err = train(capfd, *same, "--steps", "2")
    assert list(first) == [1, 2] and "no checkpoint in" in err and "saved step 1" in err and "saved step 2" in err
    again, err = train(capfd, *same, "--steps", "3")
    straight, _ = train(capfd, "--dp", "1", "--pp", "2", "--tp", "1", "--steps", "3")
    assert list(again) == [3] and {**first, **again} == straight


def test_the_layout_groups_that_span_nodes_are_named():
    from minipar.hybrid.cli import groups_across_nodes
    from minipar.layout import Layout
    assert groups_across_nodes(Layout(tp=4), 4, 2) == {"tp": [([0, 1, 2, 3], [0, 1])]}
    assert groups_across_nodes(Layout(dp=2, tp=2), 4, 2) == {"dp": [([0, 2], [0, 1]), ([1, 3], [0, 1])]}
    assert groups_across_nodes(Layout(dp=2, tp=2), 4, 4) == {}


def test_a_tp_group_across_nodes_warns_or_is_refused(capsys, monkeypatch):
    err = refused(capsys, monkeypatch, "--tp", "4", "--nproc-per-node", "2", "--strict-nodes", *SMALL)
    assert "--strict-nodes: tp group [0, 1, 2, 3] spans nodes [0, 1] (2 ranks per node)" in err
    monkeypatch.setattr("minipar.launcher.launch", lambda *a, **k: [])
    assert main(["--tp", "2", "--dp", "2", "--nproc-per-node", "2", *SMALL]) == 0
    err = capsys.readouterr().err
    assert "2 nodes of 2 ranks; tp groups: [0, 1] on node [0]; [2, 3] on node [1]" in err and "warning" not in err
    assert main(["--tp", "4", "--nproc-per-node", "2", *SMALL]) == 0
    assert "warning: tp group [0, 1, 2, 3] spans nodes [0, 1]" in capsys.readouterr().err


def children(pid: int) -> list:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def command(*flags, env=None):
    return subprocess.Popen([sys.executable, "-m", "minipar", "train", *flags], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait_for(proc, words: str) -> None:
    for line in proc.stderr:                       # the ranks' progress lines, as they happen
        if words in line:
            return
    pytest.fail(f"the run ended without printing {words!r}")


def checkpoint_tensors(folder):
    from minipar.hybrid import checkpoint
    latest = checkpoint.latest(folder)
    shards = sorted(f for f in os.listdir(latest) if f.startswith("stage-"))
    return [torch.load(os.path.join(latest, f), weights_only=True) for f in shards]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the ranks through /proc")
def test_a_rank_killed_mid_run_then_the_same_command_reaches_the_uninterrupted_result(capfd, tmp_path,
                                                                                      tmp_path_factory):
    steps, folder = str(KILLED_STEPS), str(tmp_path / "run")
    same = [*PP2_TP2, "--steps", steps, *SMALL, "--json", "--save-every", "1", "--resume", folder, "--save", folder]
    first = command(*same)
    wait_for(first, "saved step 3 ")
    os.kill(children(first.pid)[-1], signal.SIGKILL)            # one rank dies mid-run
    _, err = first.communicate(timeout=300)
    assert first.returncode != 0, err
    # the same command again, and the uninterrupted one, in this process (main() is what `python -m minipar train`
    # runs; only the killed run needs a process of its own): two fewer `import torch`
    resumed = json_losses(capfd, *same)
    assert 3 < min(resumed) and max(resumed) == int(steps)       # it went on from a checkpoint after step 3
    losses, straight = uninterrupted_pp2_tp2(capfd, tmp_path_factory)   # the same command less the 6 save flags
    assert resumed == {s: losses[s] for s in resumed}             # bit for bit: same layout, same arithmetic
    killed, uninterrupted = checkpoint_tensors(folder), checkpoint_tensors(straight)
    assert len(killed) == len(uninterrupted) == 2                 # the two stages' parameters and Adam moments
    for mine, theirs in zip(killed, uninterrupted):
        assert all(torch.equal(a, b) for a, b in zip(_leaves(mine), _leaves(theirs), strict=True))


def json_losses(capfd, *flags) -> dict:
    """``main(flags)`` (flags with --json) in this process: {step: loss} from its stdout."""
    capfd.readouterr()
    assert main(list(flags)) == 0, capfd.readouterr().err[-3000:]
    return {d["step"]: d["loss"] for d in map(json.loads, capfd.readouterr().out.splitlines())}


def _leaves(tree):
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in _leaves(tree[k])]
    return [tree]


def test_sigterm_stops_the_ranks_and_leaves_no_temp_folder(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = command("--pp", "2", "--steps", "4000", *SMALL, env=env)
    wait_for(proc, "step    2/")
    ranks = children(proc.pid)
    assert any(name.startswith("minipar-") for name in os.listdir(tmp_path))
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not [name for name in os.listdir(tmp_path) if name.startswith("minipar-")]
    assert ranks and not [pid for pid in ranks if alive(pid)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# Two torchrun agents as two nodes (--nnodes 2 on localhost, LOCAL_WORLD_SIZE < WORLD_SIZE): the command names each
# tp group's node, warns of none, and trains equal to one process. test_sixteen_moe_ranks_under_torchrun_then_resume_
# at_ep_4 asserts all of it of its 16-rank run, launched as two agents of 8: one torchrun launch, not two (a 2 × 2
# run of its own started 6 more Python processes, ~35 CPU-s on two cores, for the same checks).


TEXT = ("Il était une fois un modèle trop grand pour un seul appareil. 数据并行 copies the model; 流水线并行 "
        "cuts it into stages; 张量并行 splits one matrix multiplication. ") * 12


def test_training_on_a_text_file_logs_the_held_out_loss(capfd, tmp_path):
    """--data: character tokens of a UTF-8 file, the last tenth held out; the held-out loss every 2 steps equals
    the loss of the one-device reference's parameters on the same held-out batch, in the 3D layout too."""
    from types import SimpleNamespace

    from minipar.check import train_reference
    from minipar.datasets import lm_batch
    from minipar.hybrid import cli, preflight
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    flags = ["--data", str(path), "--tokens", "char", "--steps", "4", "--eval-every", "2"]
    capfd.readouterr()
    assert main([*flags, *SMALL, "--json", "--pp", "2", "--tp", "2"]) == 0
    out, err = capfd.readouterr()
    lines = {d["step"]: d for d in map(json.loads, out.splitlines())}
    assert [s for s, d in lines.items() if "eval_loss" in d] == [2, 4] and "held-out" in err
    args = SimpleNamespace(data=str(path), tokens="char", steps=2, batch_size=8, seq_len=8, seed=0, n_layer=4,
                           n_head=4, n_embd=32, dtype="float64")
    data = preflight.text_data(args)
    assert data["vocab_size"] == len(set(TEXT)) and len(data["held_out"]) == len(TEXT) // 10
    recipe = cli.make_recipe(args, data)
    model = recipe.model().to(torch.float64)
    model.load_state_dict(train_reference(recipe).params)
    with torch.no_grad():
        want = float(recipe.loss(model, *lm_batch(data["held_out"], 8, 8, 0, seed=0)))
    assert lines[2]["eval_loss"] == pytest.approx(want, rel=1e-10)
    assert lines[4]["eval_loss"] != lines[2]["eval_loss"]


def test_a_text_file_that_cannot_be_used_is_refused(capsys, monkeypatch, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    short = tmp_path / "short.txt"
    short.write_text("tiny", encoding="utf-8")
    assert "is not UTF-8 text (byte 3" in refused(capsys, monkeypatch, "--data", str(latin1))
    assert "cannot read" in refused(capsys, monkeypatch, "--data", str(tmp_path / "missing.txt"))
    assert "needs at least 18" in refused(capsys, monkeypatch, "--data", str(short), "--seq-len", "16")
    assert "--eval-every must be a positive integer" in refused(capsys, monkeypatch, "--eval-every", "0")


def test_a_torchrun_world_that_is_not_the_layout_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    err = refused(capsys, monkeypatch, "--tp", "2", *SMALL)
    assert "torchrun started 3 processes, but the layout (tp 2) has 2 ranks" in err


# ------------------------------------------------------------------------------------------------------
# 16 ranks: dp 2 × cp 2 × pp 2 × tp 2 from the shell, equal to one process (float64, rel 1e-12); its
# checkpoints resume at layouts with another cp and tp to the same next loss. Under torchrun the same 16-rank
# mesh runs below with experts (all five dimensions > 1): one torchrun test of 16 ranks, not two (each imports
# torch 16 times, ~45 s on two cores), since the launcher gives the trainer the same ranks and groups either way
# ------------------------------------------------------------------------------------------------------

FIVE_D = ["--dp", "2", "--cp", "2", "--pp", "2", "--tp", "2", "--cp-method", "ring-zigzag"]


def _same(got: dict, want: dict):
    assert got.keys() <= want.keys() and got
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=1e-12, abs=1e-12), s


def test_sixteen_ranks_equal_one_process_and_resume_at_another_cp_and_tp(capfd, tmp_path):
    one_process_3_steps = one_process(capfd)
    first, err = train(capfd, *FIVE_D, "--steps", "2", "--save", str(tmp_path))
    assert list(first) == [1, 2] and err.count("step    1/") == 1 and "saved step 2" in err
    _same(first, one_process_3_steps)
    resumed, _ = train(capfd, "--dp", "4", "--cp", "1", "--pp", "2", "--tp", "2", "--steps", "3",
                       "--resume", str(tmp_path))                      # 16 ranks again: cp 2 -> 1, dp 2 -> 4
    assert list(resumed) == [3]
    _same(resumed, one_process_3_steps)
    resumed, _ = train(capfd, "--dp", "2", "--cp", "2", "--pp", "2", "--tp", "1", "--cp-method", "ulysses",
                       "--steps", "3", "--resume", str(tmp_path))      # 8 ranks: tp 2 -> 1, ring-zigzag -> Ulysses
    assert list(resumed) == [3]
    _same(resumed, one_process_3_steps)


# ------------------------------------------------------------------------------------------------------
# 16 ranks with all five dimensions > 1: dp 2 × cp 2 × pp 2 × tp 2, ep 2 folded into dp × cp (the MoE GPT);
# saved there, resumed at another cp, ep and tp (4 ranks) to the same next loss
# ------------------------------------------------------------------------------------------------------

MOE = ["--experts", "4", "--top-k", "1", "--capacity-factor", "4"]      # no-drop capacity: cf = E/k (cp > 1)
FIVE_D_MOE = [*FIVE_D, "--ep", "2", *MOE]


_MOE_RUNS = {}


def moe_one_process(steps: int) -> dict:
    """The single-device losses of the command's MoE run: its recipe (the loss of dp 2 × m 2: f counted per global
    micro-batch, :func:`minipar.hybrid.experts.reference_loss`) trained on one process (once per module)."""
    from minipar.check import train_reference
    from minipar.hybrid.cli import build_parser, make_recipe
    if ("one", steps) not in _MOE_RUNS:
        args = build_parser().parse_args([*FIVE_D_MOE, "--steps", str(steps), *SMALL])
        _MOE_RUNS["one", steps] = dict(enumerate(train_reference(make_recipe(args)).losses, start=1))
    return dict(_MOE_RUNS["one", steps])


def sixteen_moe_ranks_on_local_ranks(capfd, tmp_path_factory) -> tuple:
    """The 16-rank MoE command on local (forked) ranks, 2 steps, saved: (losses, stderr, folder), run once per
    module: its own test checks it and resumes from it; the torchrun test checks torchrun's ranks give its losses."""
    if "local" not in _MOE_RUNS:
        folder = str(tmp_path_factory.mktemp("moe16"))
        losses, err = train(capfd, *FIVE_D_MOE, "--steps", "2", "--save", folder)
        _MOE_RUNS["local"] = losses, err, folder
    return _MOE_RUNS["local"]


def test_sixteen_moe_ranks_equal_one_process_and_resume_at_another_cp_ep_and_tp(capfd, monkeypatch,
                                                                                tmp_path_factory):
    first, err, folder = sixteen_moe_ranks_on_local_ranks(capfd, tmp_path_factory)
    assert list(first) == [1, 2] and "saved step 2" in err
    one = moe_one_process(3)
    _same(first, one)
    manifest = json.load(open(os.path.join(folder, open(os.path.join(folder, "latest")).read(), "manifest.json")))
    assert {f for f in manifest["files"] if f.startswith("experts-")} == {f"experts-{s}-ep{e}.pt" for s in (0, 1)
                                                                           for e in (0, 1)}
    resumed, _ = train(capfd, "--dp", "2", "--cp", "1", "--pp", "2", "--tp", "1", "--ep", "1", *MOE, "--steps", "3",
                       "--resume", str(folder))                     # 4 ranks: cp 2 -> 1, ep 2 -> 1, tp 2 -> 1
    assert list(resumed) == [3]
    _same(resumed, one)
    err = refused(capfd, monkeypatch, "--dp", "2", "--pp", "2", *MOE[:-2], "--capacity-factor", "1",
                  "--steps", "3", *SMALL, "--resume", str(folder))
    assert "config.moe_capacity_factor: checkpoint 4.0, this run 1.0" in err


def test_sixteen_moe_ranks_under_torchrun_then_resume_at_ep_4(capfd, tmp_path, tmp_path_factory):
    """The same 16-rank MoE run under torchrun, as two agents of 8 processes (two nodes on localhost: the command
    says where each tp group sits, and that none spans nodes), saved there, resumed locally on 8 ranks with ep 2 -> 4,
    tp 2 -> 1 and cp's method ring-zigzag -> Ulysses: the losses equal one process's, and the local launcher's bit
    for bit (the same ranks, the same arithmetic, another launcher)."""
    under_torchrun, err = train_under_torchrun_as_two_nodes(8, *FIVE_D_MOE, "--steps", "2", *SMALL,
                                                            "--save", str(tmp_path))
    placed = "; ".join(f"[{r}, {r + 1}] on node [{r // 8}]" for r in range(0, 16, 2))
    assert f"2 nodes of 8 ranks; tp groups: {placed}" in err and "warning" not in err
    assert list(under_torchrun) == [1, 2]
    assert under_torchrun == sixteen_moe_ranks_on_local_ranks(capfd, tmp_path_factory)[0]
    one = moe_one_process(3)
    _same(under_torchrun, one)
    resumed, _ = train(capfd, "--dp", "2", "--cp", "2", "--pp", "2", "--tp", "1", "--ep", "4", *MOE,
                       "--cp-method", "ulysses", "--steps", "3", "--resume", str(tmp_path))
    assert list(resumed) == [3]
    _same(resumed, one)

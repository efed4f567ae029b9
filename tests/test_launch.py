"""The launcher: results, captured output, errors naming the rank, deadlocks, interrupts, no leftovers."""
import faulthandler
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from minipar import LaunchTimeout, RankError, comm, hooks, launch
from conftest import child_pids


def _rank_and_sum(rank, world_size, offset):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank + offset, t.item(), torch.get_num_threads()


def test_returns_per_rank_results_in_order(no_leftover_processes):
    results = launch(_rank_and_sum, 4, 10)
    assert [r[0] for r in results] == [10, 11, 12, 13]
    assert all(r[1] == 6.0 for r in results)          # 0+1+2+3, through a real all-reduce
    assert all(r[2] == 1 for r in results)            # every rank set_num_threads(1) first


def test_output_is_shown_after_the_run_in_rank_order(capsys):
    def speak(rank, world_size):
        time.sleep(0.05 * (world_size - rank))        # finish in reverse order
        print(f"hello from {rank}")
    launch(speak, 3)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[rank 0] hello from 0", "[rank 1] hello from 1", "[rank 2] hello from 2"]


def test_quiet_hides_output(capsys):
    launch(lambda rank, world_size: print("noise"), 2, quiet=True)
    assert capsys.readouterr().out == ""


def test_a_raising_rank_is_named_quickly_while_others_wait(no_leftover_processes):
    def fail_on_two(rank, world_size):
        if rank == 2:
            raise ValueError("rank two is broken")
        dist.barrier()                                 # the others wait for rank 2 forever
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(fail_on_two, 4, timeout=30)
    assert time.monotonic() - t0 < 20                  # well before the collective timeout
    assert info.value.rank == 2
    assert "rank 2 failed: ValueError: rank two is broken" in str(info.value)
    assert "fail_on_two" in info.value.rank_traceback


def test_a_deadlock_raises_launch_timeout(no_leftover_processes):
    def both_receive(rank, world_size):
        t = torch.zeros(1)
        dist.recv(t, src=1 - rank)                     # each waits for the other: nobody sends
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(both_receive, 2, timeout=2)
    assert time.monotonic() - t0 < 20
    assert "deadlock" in str(info.value)


def test_a_rank_that_dies_is_named(no_leftover_processes):
    def die(rank, world_size):
        if rank == 1:
            os._exit(3)
        dist.barrier()
    with pytest.raises(RankError, match="rank 1 failed: process exited with code 3"):
        launch(die, 3, timeout=30)


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL, signal.SIGTERM])
def test_a_rank_killed_by_a_signal_names_the_signal(no_leftover_processes, sig):
    def killed(rank, world_size, sig):
        if rank == 1:
            faulthandler.disable()                     # pytest's handler would print a "Fatal Python error"
            os.kill(os.getpid(), sig)
        dist.barrier()
    with pytest.raises(RankError, match=f"rank 1 failed: process was killed by {sig.name} \\(signal {int(sig)}"):
        launch(killed, 2, sig, timeout=30)


def test_describe_exit_explains_codes_and_unknown_signals():
    from minipar.launcher import describe_exit
    assert "segmentation fault" in describe_exit(-11)
    assert describe_exit(3).startswith("exited with code 3")
    assert describe_exit(-200) == "was killed by signal 200"


def test_unpicklable_return_value_is_a_clear_error():
    with pytest.raises(RankError, match="cannot be pickled"):
        launch(lambda rank, world_size: threading.Lock(), 2)


def test_twenty_launches_in_a_row_leave_nothing_behind():
    for i in range(20):
        assert launch(lambda rank, world_size: rank * i, 4, quiet=True) == [0, i, 2 * i, 3 * i]
        assert child_pids() == []


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler for the test: a process started in the background by a non-interactive shell
    (``make test &``) inherits SIGINT ignored, and Python then leaves it ignored — the interrupt would never come."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.serial   # SIGINT to this process: under pytest-xdist it would also stop the worker's channel
def test_interrupt_stops_every_rank(ctrl_c_raises):
    def sleep_forever(rank, world_size):
        time.sleep(600)
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        launch(sleep_forever, 4, wall_limit=120)    # the interrupt comes after 1 s; never a 10-minute hang
    timer.join()
    assert child_pids() == []
    assert launch(lambda rank, world_size: rank, 2) == [0, 1]  # the next launch works


@pytest.mark.parametrize("bad", [0, -1, 2.0, "4", True, None])
def test_world_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        launch(lambda rank, world_size: None, bad)


def test_refuses_when_a_process_group_exists(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already has a torch.distributed process group"):
            launch(lambda rank, world_size: None, 2)
    finally:
        dist.destroy_process_group()


_SPAWNED = []


def spawned_once() -> list:
    """One launch with start_method="spawn", made once for the three tests that need one (a spawned rank imports
    torch afresh: seconds of CPU each): a lambda closing over ``scale`` (only cloudpickle carries it), an argument
    that takes rank 1 4 s to unpickle (twice the 2 s collective timeout), and the frames each rank was called
    from. Per rank: (rank * scale, x + rank, frames)."""
    if not _SPAWNED:
        scale = 3

        def late_on_rank_1(x):
            if os.environ.get("LOCAL_RANK") == "1":
                time.sleep(4)
            return x

        class LateToUnpickle:
            def __reduce__(self):
                return late_on_rank_1, (7,)

        def frames():
            import traceback
            return [frame.filename for frame in traceback.extract_stack()]
        _SPAWNED.append(launch(lambda rank, world_size, x: (rank * scale, x + rank, frames()), 2, LateToUnpickle(),
                               timeout=2, start_method="spawn"))
    return _SPAWNED[0]


def test_spawn_carries_a_lambda_with_cloudpickle(no_leftover_processes):
    assert [scaled for scaled, _, _ in spawned_once()] == [0, 3]


def test_same_function_runs_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from minipar import launch
        def job(rank, world_size):
            t = torch.tensor([rank + 1.0]); dist.all_reduce(t); return t.item()
        if __name__ == "__main__":
            results = launch(job, 2)
            with open(f"{__file__}.{dist.get_rank()}.out", "w") as f:
                f.write(repr(results))
    """))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in (0, 1):                                  # every rank gets every rank's result
        assert (tmp_path / f"job.py.{rank}.out").read_text() == "[3.0, 3.0]"


def test_the_rank_that_raised_is_blamed_not_the_peer_that_lost_it(no_leftover_processes):
    """Rank 3 raises; rank 0 then fails only because its peer went away. Index order would name rank 0."""
    def fail_on_three(rank, world_size):
        if rank == 3:
            raise KeyError("the real cause")
        t = torch.zeros(1)
        if rank == 0:
            dist.recv(t, src=3)                          # fails with "connection closed by peer"
        else:
            time.sleep(30)
    with pytest.raises(RankError) as info:
        launch(fail_on_three, 4, timeout=30)
    assert info.value.rank == 3 and "the real cause" in str(info.value)


def test_a_rank_that_returns_early_does_not_break_a_peer_still_connecting():
    """gloo connects inside init and inside every new_group: a rank that returned and left used to make
    a slower peer fail with 'connection closed by peer' (seen in CI). Ranks now leave together."""
    from minipar import Mesh

    def build_groups(rank, world_size):
        Mesh(world_size, tp=world_size).build(rank)
        return rank
    for _ in range(30):
        assert launch(build_groups, 2, quiet=True) == [0, 1]


def test_calling_different_collectives_is_reported_not_hung(no_leftover_processes):
    def mismatch(rank, world_size):
        if rank == 0:
            dist.barrier()                               # rank 1 never joins
    with pytest.raises(LaunchTimeout, match="rank 0"):
        launch(mismatch, 2, timeout=2)


def _compute_then_all_reduce(rank, world_size, seconds, step):
    """Every rank works (sleeps: CPU-free) for ``seconds`` in steps shorter than the collective timeout,
    meeting the others in an all-reduce after each step: a long run that is making progress."""
    t0, rounds = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        time.sleep(step)
        t = torch.ones(1)
        dist.all_reduce(t)
        rounds += 1
    return rounds, t.item()


def test_a_long_run_making_progress_is_not_killed(no_leftover_processes):
    """The launcher used to cut every run off at 2 * timeout + 30 s ("deadlock?"): 36 s for timeout=3.
    Each round leaves 2.75 s of slack for a rank woken late: with 1 s of slack (step 1 s, timeout 2 s)
    CI's loaded machine once woke a rank more than a second late and gloo's timeout fired."""
    t0 = time.monotonic()
    results = launch(_compute_then_all_reduce, 2, 37.0, 0.25, timeout=3)
    assert time.monotonic() - t0 > 37
    assert all(rounds >= 10 and total == 2.0 for rounds, total in results)   # ~140 unloaded


def test_a_rank_that_starts_late_is_waited_for_not_called_a_deadlock(no_leftover_processes):
    """Rank 1 reaches the rendezvous 4 s after rank 0 (its arguments take that long to unpickle: a slow,
    loaded machine), twice the 2 s collective timeout: the ranks meet on the store first, so the short
    timeout bounds the collectives only, not the start."""
    assert [late for _, late, _ in spawned_once()] == [7, 8]       # the launch: spawned_once()


def test_a_rank_may_compute_without_collectives_longer_than_the_timeout(no_leftover_processes):
    """Rank 0 returns at once; rank 1 computes for 3x the collective timeout. Nobody is waiting in a
    collective, so nothing is a deadlock: both results come back."""
    def uneven(rank, world_size):
        if rank == 1:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 6.0:            # a Python loop, 3 x timeout
                sum(range(1000))
        return rank
    assert launch(uneven, 2, timeout=2) == [0, 1]


def test_a_deadlock_is_still_reported_by_the_collective_timeout_naming_the_rank(no_leftover_processes):
    def rank1_never_arrives(rank, world_size):
        if rank == 1:
            time.sleep(600)                                # computing (forever) instead of joining
        dist.barrier()
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(rank1_never_arrives, 2, timeout=2)
    assert time.monotonic() - t0 < 20
    assert info.value.rank == 0 and "rank 0 failed" in str(info.value) and "timeout" in str(info.value)


def test_wall_limit_stops_a_run_that_is_still_working(no_leftover_processes):
    def sleep_long(rank, world_size):
        print("started")
        time.sleep(600)
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout, match=r"still running at the wall-clock limit of 1 s") as info:
        launch(sleep_long, 2, wall_limit=1)
    assert time.monotonic() - t0 < 20
    assert info.value.rank == 0 and "started" in info.value.output


@pytest.mark.parametrize("bad", [0, -1.0])
def test_wall_limit_must_be_positive(bad):
    with pytest.raises(ValueError, match="wall_limit must be positive"):
        launch(lambda rank, world_size: None, 2, wall_limit=bad)


class _Recorder:
    """A stand-in for sys.stdout that notes when each piece of text arrived."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append((time.monotonic(), text))
        return len(text)

    def flush(self):
        pass

    def lines(self):
        return "".join(text for _, text in self.writes).splitlines()

    def time_of(self, line):
        return min(t for t, text in self.writes if line in text)


def test_stream_prints_each_line_while_the_ranks_run(monkeypatch):
    def talk(rank, world_size):
        print(f"early {rank}")
        time.sleep(2.0)
        print(f"late {rank}", end="")                     # no final newline: still printed at the end
    out = _Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    launch(talk, 2, stream=True)
    end = time.monotonic()
    assert end - out.time_of("[rank 0] early 0") > 1.0   # seen while the ranks were still sleeping
    assert end - out.time_of("[rank 1] early 1") > 1.0
    assert sorted(out.lines()) == ["[rank 0] early 0", "[rank 0] late 0", "[rank 1] early 1", "[rank 1] late 1"]


def test_stream_shows_a_progress_bar_redraw_as_lines(monkeypatch):
    def progress(rank, world_size):
        if rank == 0:
            for pct in (50, 100):
                sys.stdout.write(f"\rstep {pct}%")
            sys.stdout.write("\n")
    out = _Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    launch(progress, 2, stream=True)
    assert out.lines() == ["[rank 0] step 50%", "[rank 0] step 100%"]


def test_stream_output_comes_before_the_error(monkeypatch):
    def fail(rank, world_size):
        print(f"before {rank}")
        if rank == 1:
            raise ValueError("boom")
        dist.barrier()
    out = _Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    with pytest.raises(RankError, match="rank 1 failed: ValueError: boom"):
        launch(fail, 2, stream=True, timeout=30)
    assert "[rank 1] before 1" in out.lines()


def test_ranks_are_started_through_torch_multiprocessing():
    def started_by(rank, world_size):
        import traceback
        return [frame.filename for frame in traceback.extract_stack()]
    spawned = [frames for _, _, frames in spawned_once()]         # spawn's launch: shared, see spawned_once()
    for frames in [*launch(started_by, 2, start_method="fork"), *spawned]:
        assert any(f.replace(os.sep, "/").endswith("torch/multiprocessing/spawn.py") for f in frames)


def test_a_folder_left_by_a_killed_launcher_is_removed_by_the_next_launch(tmp_path):
    """SIGKILL skips the launcher's ``finally``: its ``minipar-<pid>-*`` folder stays behind. The next launch
    removes folders whose launcher is gone and keeps a live one's."""
    import os
    import subprocess
    import sys
    import tempfile
    from minipar.launcher import remove_stale_workdirs
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tempfile.mkdtemp(prefix=f"minipar-{dead.pid}-", dir=tmp_path)
    alive = tempfile.mkdtemp(prefix=f"minipar-{os.getpid()}-", dir=tmp_path)
    other = tempfile.mkdtemp(prefix="minipar-notapid-", dir=tmp_path)
    removed = remove_stale_workdirs(str(tmp_path))
    assert removed == [os.path.basename(gone)]
    assert not os.path.exists(gone) and os.path.exists(alive) and os.path.exists(other)


def test_launch_names_its_folder_after_the_launcher(tmp_path, monkeypatch):
    import os
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = launch(_workdir_name, 2, quiet=True)
    assert all(name.startswith(f"minipar-{os.getpid()}-") for name in seen), seen
    assert not any(n.startswith("minipar-") for n in os.listdir(tmp_path))     # removed after the run


def _workdir_name(rank, world_size):
    import os
    import tempfile
    return next(n for n in os.listdir(tempfile.gettempdir()) if n.startswith("minipar-"))


def _hooks_in_a_rank(rank, world_size):
    outside = [type(h).__name__ for h in hooks.active()]
    with comm.recording() as log:
        comm.all_reduce(torch.ones(1000))
    return outside, log.records[0].observed_sent


def test_a_rank_begins_its_own_hook_scope():
    """A rank forked inside a recording block carries none of its parent's hooks (the parent's log, or its wire
    counter, whose /proc/self/io is the parent's): only its flight recorder; its own log counts its own bytes."""
    with comm.recording() as parent_log:
        results = launch(_hooks_in_a_rank, 2, quiet=True)
    assert [outside for outside, _ in results] == [["FlightRecorder"]] * 2
    assert all(observed >= 4000 for _, observed in results)        # 2(N-1)/N · 4000 bytes, and gloo's headers
    assert parent_log.records == []

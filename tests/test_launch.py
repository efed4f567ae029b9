"""The launcher: results, captured output, errors naming the rank, deadlocks, interrupts, no leftovers."""
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

from minipar import LaunchTimeout, RankError, launch
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
    assert time.monotonic() - t0 < 10                  # well before the collective timeout
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


def test_unpicklable_return_value_is_a_clear_error():
    with pytest.raises(RankError, match="cannot be pickled"):
        launch(lambda rank, world_size: threading.Lock(), 2)


def test_twenty_launches_in_a_row_leave_nothing_behind():
    for i in range(20):
        assert launch(lambda rank, world_size: rank * i, 4, quiet=True) == [0, i, 2 * i, 3 * i]
        assert child_pids() == []


def test_interrupt_stops_every_rank():
    def sleep_forever(rank, world_size):
        time.sleep(600)
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        launch(sleep_forever, 4)
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


def test_spawn_carries_a_lambda_with_cloudpickle():
    scale = 3
    assert launch(lambda rank, world_size: rank * scale, 2, start_method="spawn") == [0, 3]


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

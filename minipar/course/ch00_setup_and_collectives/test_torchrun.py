"""Chapter 00 runs torchrun for real (section 3): the same all-reduce under torchrun as under minipar.launch,
with the environment torchrun sets; a run that does not finish in time is killed with its workers."""
import os
import time

import pytest

from minipar import launch
from minipar.course.ch00_setup_and_collectives import torchrun_job
from minipar.course.ch00_setup_and_collectives.torchrun_runner import JOB, run_torchrun_job


def _job_processes() -> list:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if str(JOB).encode() in cmd and b"minipar-torchrun-" in cmd:
            found.append(int(pid))
    return found


def test_torchrun_gives_what_launch_gives_and_sets_its_environment():
    command, workers = run_torchrun_job(nproc_per_node=2, timeout=180)
    assert command.startswith("torchrun --standalone --nproc_per_node=2 ")
    assert [w["result"] for w in workers] == launch(torchrun_job.all_reduce_rank, 2, quiet=True) == [1.0, 1.0]
    for rank, w in enumerate(workers):
        env = w["env"]
        assert (w["rank"], env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (rank, str(rank), str(rank), "2")
        assert env["GROUP_RANK"] == "0" and env["NODE_RANK"] is None and env["MASTER_PORT"]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to find leftover workers")
def test_a_run_past_its_timeout_is_killed_with_its_workers():
    # 0.5 s: less than torchrun needs to import torch and start its workers, however idle the machine
    # (3 s was not: on a quiet machine the whole job finished inside it)
    with pytest.raises(RuntimeError, match="did not finish in 0.5 s"):
        run_torchrun_job(nproc_per_node=2, timeout=0.5)
    deadline = time.time() + 5
    while _job_processes() and time.time() < deadline:
        time.sleep(0.1)
    assert _job_processes() == []

"""What every torchrun worker runs in chapter 00: the all-reduce of section 3, started by torchrun instead of
by ``minipar.launch``.

    torchrun --standalone --nproc_per_node=2 minipar/course/ch00_setup_and_collectives/torchrun_job.py OUT_DIR

torchrun starts the processes and tells each one who it is through environment variables (that is its whole
interface with the worker). The worker reads ``RANK`` and ``WORLD_SIZE`` from there, joins the group with
``init_process_group("gloo")`` (the default ``env://`` rendezvous reads ``MASTER_ADDR`` and ``MASTER_PORT``),
runs :func:`all_reduce_rank` (the same function the notebook runs with ``minipar.launch``) and writes what it
got, with the variables it saw, to ``OUT_DIR/rank{RANK}.json``. It imports nothing but torch.
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

ENV = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
       "MASTER_PORT"]


def all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def main(out_dir):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])   # set by torchrun
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))    # env:// rendezvous
    try:
        result = all_reduce_rank(rank, world_size)
        dist.barrier()                      # nobody leaves while a peer may still be reading from it
    finally:
        dist.destroy_process_group()
    seen = {name: os.environ.get(name) for name in ENV}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": world_size, "result": result, "env": seen}, f)


if __name__ == "__main__":
    main(sys.argv[1])

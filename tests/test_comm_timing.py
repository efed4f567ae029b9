"""minipar.comm times an asynchronous call from its launch to its completion, not to its enqueue.

Rank 1 joins 1 s late; rank 0 launches at once. Before the fix, rank 0's record said ~0.1 ms (the time to
enqueue the work) however long the collective then took. The ranks meet in a barrier first, so that "late" counts
from the same moment on both: forked on a loaded machine, one rank may start well after the other (a make test run
beside other work once recorded 0.196 s for a 0.3 s delay, below its 0.8 bound); 1 s leaves 0.2 s for such a lag.
"""
import time

import torch
import torch.distributed as dist

from minipar import comm, launch

LATE = 1.0


def _async_all_reduce(rank, world_size):
    dist.barrier()
    if rank == 1:
        time.sleep(LATE)
    with comm.recording() as log:
        work = comm.all_reduce(torch.ones(1000), async_op=True)
        pending_at_launch = log.records[0].pending
        work.wait()
        time.sleep(0.05)                     # the future's callback runs on gloo's thread
    rec = log.records[0]
    return pending_at_launch, rec.pending, rec.seconds


def test_an_async_all_reduce_is_timed_to_its_completion():
    (pending0, done_pending0, sec0), (_, _, sec1) = launch(_async_all_reduce, 2, quiet=True, timeout=30)
    assert pending0 and not done_pending0
    assert sec0 > 0.8 * LATE, sec0          # rank 0 waited for rank 1: that is the collective's time
    assert sec1 < LATE, sec1


def _late_send(rank, world_size):
    t = torch.ones(1000)
    dist.barrier()
    with comm.recording() as log:
        if rank == 0:
            work = comm.irecv(t, 1)
            pending_at_launch = log.records[0].pending
            work.wait()
        else:
            time.sleep(LATE)
            work = comm.isend(t, 0)
            pending_at_launch = log.records[0].pending
            work.wait()
    rec = log.records[0]
    return pending_at_launch, rec.pending, rec.seconds


def test_isend_and_irecv_are_timed_to_completion_without_a_future():
    (p0, d0, recv_sec), (p1, d1, send_sec) = launch(_late_send, 2, quiet=True, timeout=30)
    assert p0 and p1 and not d0 and not d1
    assert recv_sec > 0.8 * LATE, recv_sec  # the receive waited for the late sender
    assert send_sec < LATE, send_sec


def _blocking(rank, world_size):
    dist.barrier()
    if rank == 1:
        time.sleep(LATE)
    with comm.recording() as log:
        comm.all_reduce(torch.ones(10))
    return log.records[0].pending, log.records[0].seconds


def test_blocking_calls_are_unchanged():
    (pending, sec), _ = launch(_blocking, 2, quiet=True, timeout=30)
    assert not pending and sec > 0.8 * LATE

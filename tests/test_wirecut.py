"""minipar.observe.wirecut: inside ``cut_wire()`` minipar.comm moves nothing, never waits, and leaves outputs of the
right shape; outside it, everything is as before."""
import time

import pytest
import torch
import torch.distributed as dist

from minipar import comm, launch
from minipar import wire
from minipar.observe.wirecut import cut_wire


def _collectives(rank, world_size):
    """Each collective under the cut: what its output holds, and that the real ones work afterwards."""
    out = {}
    with cut_wire():
        t = torch.full((4,), float(rank + 1))
        comm.all_reduce(t)
        out["all_reduce"] = t.tolist()                            # untouched: nothing was summed
        slots = [torch.zeros(2) for _ in range(world_size)]
        comm.all_gather(slots, torch.full((2,), float(rank)))
        out["all_gather"] = [s.tolist() for s in slots]           # every slot holds this rank's piece
        flat = torch.zeros(2 * world_size)
        comm.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
        out["all_gather_flat"] = flat.tolist()
        piece = torch.zeros(2)
        comm.reduce_scatter_tensor(piece, torch.arange(2.0 * world_size))
        out["reduce_scatter"] = piece.tolist()                    # this rank's own chunk, not reduced
        buf = torch.full((3,), float("nan"))
        comm.recv(buf, 1 - rank)                                  # nobody sends: returns at once, zeros
        out["recv"] = buf.tolist()
        work = comm.isend(torch.ones(3), 1 - rank)
        out["isend_done"] = work.is_completed() and work.wait()
    t = torch.full((1,), float(rank + 1))
    comm.all_reduce(t)                                           # the real collective is back
    out["after"] = t.item()
    return out


def test_each_collective_leaves_right_shaped_outputs_and_the_real_ones_come_back():
    r0, r1 = launch(_collectives, 2, quiet=True)
    assert r0["all_reduce"] == [1.0] * 4 and r1["all_reduce"] == [2.0] * 4
    assert r1["all_gather"] == [[1.0, 1.0], [1.0, 1.0]]
    assert r1["all_gather_flat"] == [1.0, 1.0, 1.0, 1.0]
    assert r0["reduce_scatter"] == [0.0, 1.0] and r1["reduce_scatter"] == [2.0, 3.0]
    assert r0["recv"] == [0.0] * 3 and r0["isend_done"]
    assert r0["after"] == r1["after"] == 3.0


def _no_wait(rank, world_size):
    """Rank 1 sleeps 1 s before its collective; under the cut rank 0 does not wait for it, and the calls
    are still logged with the bytes they would have sent, while the socket saw none of them."""
    with comm.recording() as log, cut_wire():
        if rank == 1:
            time.sleep(1.0)
        t0 = time.perf_counter()
        comm.all_reduce(torch.zeros(1 << 16))
        comm.send(torch.zeros(1 << 16), 1 - rank)
        waited = time.perf_counter() - t0
    return waited, log.bytes_sent, log.observed_bytes_sent


def test_no_rank_waits_nothing_crosses_the_wire_and_the_log_still_counts():
    (waited, logged, observed), _ = launch(_no_wait, 2, quiet=True)
    assert waited < 0.5                                           # the real all-reduce would wait 1 s
    assert logged == 2 * (1 << 16) * 4 * 1 // 2 + (1 << 16) * 4  # all-reduce 2(n-1)/n·S + the send's S
    if wire.available():
        assert observed < 1024                                    # 512 KiB logged, nothing written


def _dies_inside(rank, world_size):
    try:
        with cut_wire():
            raise KeyError("boom")
    except KeyError:
        pass
    return comm.dist is dist


def test_the_real_torch_distributed_is_restored_after_an_exception():
    assert all(launch(_dies_inside, 2, quiet=True))


def _ddp_step(rank, world_size, cut):
    """One DDP training run: its final parameters, and the bytes the sockets saw during the steps."""
    from minipar.check import gpt_recipe
    from minipar.data import ddp
    recipe = gpt_recipe(steps=2, batch_size=4, seq_len=8)
    log = comm.CommLog()
    if cut:
        with cut_wire():
            result = ddp.parallel_train(rank, world_size, recipe, step_log=log)
    else:
        result = ddp.parallel_train(rank, world_size, recipe, step_log=log)
    return result.params, log.bytes_sent, log.observed_bytes_sent


def _real_then_cut(rank, world_size):
    """Both runs in one launch (one set of processes instead of two): the real one first, then the cut one."""
    return _ddp_step(rank, world_size, False), _ddp_step(rank, world_size, True)


def test_a_cut_ddp_step_computes_but_does_not_average():
    """Real DDP: both ranks end with the same parameters (the all-reduce averaged their gradients). Cut:
    each rank stepped on its own half-batch's gradients, so they differ — the compute ran, the averaging
    did not — and the sockets stayed silent while the log counted the same bytes."""
    (real0, cut0), (real1, cut1) = launch(_real_then_cut, 2, quiet=True)
    real, cut = [real0, real1], [cut0, cut1]
    name = next(iter(real[0][0]))
    assert torch.equal(real[0][0][name], real[1][0][name])
    assert not all(torch.equal(cut[0][0][k], cut[1][0][k]) for k in cut[0][0])
    assert cut[0][1] == real[0][1] > 0
    if wire.available():
        assert real[0][2] >= real[0][1] and cut[0][2] < 1024


@pytest.mark.parametrize("name", ["DDP", "ZeRO-3", "1F1B", "TP + SP"])
def test_every_step_strategy_runs_with_the_wire_cut(name):
    """Appendix A times each strategy with the wire cut: each must run to its end that way (no wait on a
    message that never comes, no shape error from a collective's output)."""
    from minipar.course.chA_how_minipar_measures import bench
    for run in launch(bench._timed_train, 2, name, 3, True, quiet=True):
        step = min(b - a for a, b in zip(run.stamps, run.stamps[1:]))
        assert step > 0 and 0 <= run.result < step              # the cut's collectives take no time

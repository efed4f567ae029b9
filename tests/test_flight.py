"""The flight recorder: where the ranks' programs parted, in the launcher's error; diagnose on hand-written records."""
import faulthandler
import multiprocessing
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from minipar import LaunchTimeout, RankError, comm, flight, launch
from conftest import child_pids


def _skip_one_all_reduce(rank, world_size):
    for i in range(5):
        if rank == 2 and i == 2:                  # the planted bug: rank 2 skips the third all-reduce
            continue
        comm.all_reduce(torch.ones(1024))


def test_a_skipped_all_reduce_is_named_with_rank_seq_and_op(no_leftover_processes):
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as caught:
        launch(_skip_one_all_reduce, 4, timeout=3, quiet=True)
    assert time.monotonic() - start < 20           # the 3 s timeout, 1 s grace, starting 4 ranks on a busy machine
    message = str(caught.value)
    # Ranks 0, 1, 3 pair their 3rd, 4th all-reduce with rank 2's 4th, 5th; their 5th is never issued by rank 2.
    assert ("rank 2 never issued call #5 (all_reduce over ranks [0, 1, 2, 3], float32[1024]); "
            "ranks 0, 1, 3 wait in it (issued, not completed) for rank 2") in message
    assert "rank 2's last call: #4" in caught.value.flight
    # the programs parted at call #3 (silently): the section names where the records disagree, not where they parted
    assert "--- the first call the ranks' records disagree on (flight recorder) ---" in message
    assert message.splitlines()[0].startswith("rank 2 parted from the others: never issued call #5 (all_reduce")
    assert multiprocessing.active_children() == [] and child_pids() == []


def _rank_two_reduces_another_shape(rank, world_size):
    faulthandler.disable()                        # gloo may abort a rank: no "Fatal Python error" from pytest's
    comm.all_reduce(torch.ones(3))
    comm.all_reduce(torch.ones(8 if rank == 2 else 4))


def test_the_first_line_names_the_rank_whose_call_differs(no_leftover_processes):
    """Whichever rank gloo fails first (often rank 0), the error's first line names rank 2, the odd one out."""
    with pytest.raises(RankError) as caught:
        launch(_rank_two_reduces_another_shape, 4, timeout=3, quiet=True)
    first = str(caught.value).splitlines()[0]
    assert first.startswith("rank 2 parted from the others at call #2 on ranks [0, 1, 2, 3]: rank 2: all_reduce "
                            "over ranks [0, 1, 2, 3], float32[8], where ranks 0, 1, 3 called all_reduce"), first
    assert caught.value.headline in first


def _skip_a_direct_all_reduce(rank, world_size):
    comm.all_reduce(torch.ones(4))                # seen by the flight recorder
    for i in range(3):
        if rank == 1 and i == 1:                  # the planted bug, in a call around minipar.comm
            continue
        dist.all_reduce(torch.ones(4))


def test_calls_through_torch_distributed_are_said_to_be_unseen(no_leftover_processes):
    with pytest.raises(LaunchTimeout) as caught:
        launch(_skip_a_direct_all_reduce, 2, timeout=3, quiet=True)
    assert caught.value.flight is None            # every minipar.comm call agrees: nothing to diagnose ...
    message = str(caught.value)
    assert flight.UNSEEN in message               # ... and the error says why the recorder cannot tell
    assert "recorded 1 minipar.comm call(s), none in flight" in message


def _different_shapes(rank, world_size):
    faulthandler.disable()                        # gloo may abort this rank: no "Fatal Python error" from pytest's
    comm.all_reduce(torch.ones(3))
    comm.all_reduce(torch.ones(4 if rank == 0 else 8))


def test_a_shape_mismatch_names_both_shapes(no_leftover_processes):
    with pytest.raises(RankError) as caught:      # gloo aborts a rank on the mismatch, or the call times out
        launch(_different_shapes, 2, timeout=3, quiet=True)
    message = str(caught.value)
    assert "ranks disagree at call #2 on ranks [0, 1]" in message
    assert "rank 0: all_reduce over ranks [0, 1], float32[4]" in message
    assert "rank 1: all_reduce over ranks [0, 1], float32[8]" in message
    assert message.splitlines()[0] == ("ranks disagree at call #2 on ranks [0, 1]: rank 0 all_reduce over ranks "
                                       "[0, 1], float32[4] vs rank 1 all_reduce over ranks [0, 1], float32[8] "
                                       "(flight recorder)")        # two ranks: neither is the odd one out


def _talk_and_keep_records(rank, world_size, folder):
    sub = dist.new_group([0, 1])
    comm.all_reduce(torch.ones(2, 3))
    if rank < 2:
        comm.all_gather([torch.empty(2) for _ in range(2)], torch.ones(2), group=sub)
    work = comm.isend(torch.ones(5), (rank + 1) % world_size)
    comm.recv(torch.empty(5), (rank - 1) % world_size)
    work.wait()
    os.link(flight.active().path, os.path.join(folder, f"flight{rank}.bin"))   # outlives the launch's workdir


def test_a_run_that_succeeds_leaves_completed_records_and_no_diagnosis():
    with tempfile.TemporaryDirectory() as folder:
        launch(_talk_and_keep_records, 3, folder, quiet=True)
        records = {rank: flight.read(os.path.join(folder, f"flight{rank}.bin")) for rank in range(3)}
    assert [r["op"] for r in records[0]] == ["all_reduce", "all_gather", "send", "recv"]
    assert [r["op"] for r in records[2]] == ["all_reduce", "send", "recv"]
    assert [r["seq"] for r in records[2]] == [1, 2, 3]
    assert all(r["state"] == "completed" for recs in records.values() for r in recs)
    first = records[0][0]
    assert (first["ranks"], first["shape"], first["dtype"]) == ([0, 1, 2], [2, 3], "float32")
    assert records[0][1]["ranks"] == [0, 1] and records[0][2]["group"] == "p2p:0->1:0"
    assert flight.diagnose(records) is None


def test_no_recorder_outside_the_launcher():
    assert flight.active() is None                # this process was never a rank: no recorder is installed


# --------------------------------------------------------------------------------------------------
# diagnose, on hand-written records
# --------------------------------------------------------------------------------------------------

def _rec(seq, op, ranks, group="0", k=None, shape=(1024,), state="completed", dtype="float32"):
    return {"seq": seq, "group": group, "k": seq if k is None else k, "op": op, "ranks": list(ranks),
            "shape": list(shape), "dtype": dtype, "state": state}


WORLD = (0, 1, 2, 3)


def test_diagnose_never_issued():
    ok = [_rec(1, "all_reduce", WORLD), _rec(2, "all_reduce", WORLD)]
    waiting = ok + [_rec(3, "all_reduce", WORLD, state="issued")]
    text = flight.diagnose({0: waiting, 1: waiting, 2: ok, 3: waiting})
    assert text.startswith("rank 2 never issued call #3 (all_reduce over ranks [0, 1, 2, 3], float32[1024]); "
                           "ranks 0, 1, 3 wait in it (issued, not completed) for rank 2")


def test_diagnose_different_op():
    common = [_rec(1, "all_reduce", WORLD)]
    gathering = common + [_rec(2, "all_gather", WORLD, shape=(512,), state="issued")]
    reducing = common + [_rec(2, "all_reduce", WORLD, state="issued")]
    text = flight.diagnose({0: reducing, 1: reducing, 2: gathering, 3: reducing})
    assert text.splitlines() == ["ranks disagree at call #2 on ranks [0, 1, 2, 3]",
                                 "  ranks 0, 1, 3: all_reduce over ranks [0, 1, 2, 3], float32[1024] (issued)",
                                 "  rank 2: all_gather over ranks [0, 1, 2, 3], float32[512] (issued)"]


def test_headline_names_the_odd_rank_out_or_every_side():
    common = [_rec(1, "all_reduce", WORLD)]
    gathering = common + [_rec(2, "all_gather", WORLD, shape=(512,), state="issued")]
    reducing = common + [_rec(2, "all_reduce", WORLD, state="issued")]
    assert flight.headline({0: reducing, 1: reducing, 2: gathering, 3: reducing}) == (
        "rank 2 parted from the others at call #2 on ranks [0, 1, 2, 3]: rank 2: all_gather over ranks "
        "[0, 1, 2, 3], float32[512], where ranks 0, 1, 3 called all_reduce over ranks [0, 1, 2, 3], float32[1024]")
    assert flight.headline({0: reducing, 1: gathering}).startswith("ranks disagree at call #2 on ranks [0, 1, 2, 3]: "
                                                                   "rank 0 all_reduce")
    assert flight.headline({0: reducing, 1: common, 2: reducing, 3: reducing}).startswith(
        "rank 1 parted from the others: never issued call #2 (all_reduce over ranks [0, 1, 2, 3], float32[1024]), "
        "which ranks 0, 2, 3 issued")
    assert flight.headline({0: common, 1: common}) is None


def _sub_group_program(rank, extra_calls_on_the_pair=0):
    """Ranks 0, 1 talk on group "1"; ranks 2, 3 on group "2" (three calls vs one): their seq differ."""
    pair, name = ((0, 1), "1") if rank < 2 else ((2, 3), "2")
    calls = 3 if rank < 2 else 1
    recs = [_rec(1, "all_reduce", WORLD)]
    for k in range(1, calls + 1 + (extra_calls_on_the_pair if rank == 0 else 0)):
        recs.append(_rec(len(recs) + 1, "all_gather", pair, group=name, k=k, shape=(8,)))
    recs.append(_rec(len(recs) + 1, "all_reduce", WORLD, k=2))
    return recs


def test_diagnose_sub_groups_no_false_alarm():
    records = {rank: _sub_group_program(rank) for rank in WORLD}
    assert records[0][-1]["seq"] != records[2][-1]["seq"]           # the same world call, different seq
    assert flight.diagnose(records) is None


def test_diagnose_sub_groups_names_the_missing_member():
    records = {rank: _sub_group_program(rank, extra_calls_on_the_pair=1) for rank in WORLD}
    records[0].pop()                                  # rank 0 waits in its 4th call on the pair ...
    records[0][-1]["state"] = "issued"
    for rank in (1, 2, 3):                            # ... and the others in the world's 2nd all-reduce
        records[rank][-1]["state"] = "issued"
    paragraphs = flight.diagnose(records).split("\n")
    assert paragraphs[0].startswith("rank 0 never issued call #2 (all_reduce over ranks [0, 1, 2, 3], "
                                    "float32[1024]); rank 1's call #5 overall, rank 2's call #3 overall, "
                                    "rank 3's call #3 overall; ranks 1, 2, 3 wait in it")
    assert "rank 1 never issued call #4 (all_gather over ranks [0, 1], float32[8]); rank 0's call #5 overall; " \
           "rank 0 waits in it (issued, not completed) for rank 1" in paragraphs


def test_diagnose_ignores_ranks_it_cannot_judge():
    # Rank 1's file is missing; rank 3's older records were overwritten (its window starts at seq 3).
    mine = [_rec(s, "all_reduce", WORLD) for s in (1, 2, 3)]
    assert flight.diagnose({0: mine, 2: mine, 3: mine[2:]}) is None


def test_p2p_send_meets_recv():
    send = [_rec(1, "send", (0, 1), group="p2p:0->1:0", shape=(2, 3))]
    recv = [_rec(1, "recv", (0, 1), group="p2p:0->1:0", shape=(6,))]
    assert flight.diagnose({0: send, 1: recv}) is None               # what travels agrees: 6 floats
    text = flight.diagnose({0: send, 1: []})
    assert text.startswith("rank 1 never issued call #1 (send on 0->1, float32[2, 3]); rank 0 completed it")


def test_a_late_async_wait_does_not_mark_a_newer_call(tmp_path):
    rec = flight.FlightRecorder(str(tmp_path / "flight0.bin"), capacity=4)    # no process group: p2p only
    first = rec.issued("send", peer=1, tensor=torch.ones(3))
    for _ in range(4):                                # the ring buffer comes round to the send's slot
        rec.issued("recv", peer=1, tensor=torch.ones(3))
    rec.completed(first)                              # the isend's wait returns only now
    rec.close()
    records = flight.read(str(tmp_path / "flight0.bin"))
    assert [(r["seq"], r["op"], r["state"]) for r in records] == [(s, "recv", "issued") for s in (2, 3, 4, 5)]

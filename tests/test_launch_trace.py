"""The launcher records traces (issue 25): ``traced_launch(...)``, ``recording_launches()`` around code
that launches deep inside (a strategy's run), and ``python -m minipar tour --trace DIR``."""
import torch

from minipar import comm, launch
from minipar.machine import trace
from minipar.observe.launch_trace import recording_launches, traced_launch


def _talk(rank, world_size):
    """Blocking and async collectives and a send/recv; returns this rank's comm log as (op, ranks, bytes)."""
    with comm.recording() as log:
        x = torch.ones(1000) * rank
        comm.all_reduce(x)
        comm.all_gather_into_tensor(torch.empty(2 * 10), torch.full((10,), float(rank)))
        comm.all_reduce(torch.ones(7), async_op=True).wait()
        if rank == 0:
            comm.send(torch.ones(3), 1)
        else:
            comm.recv(torch.empty(3), 0)
        x.sum()
    return rank * 10, [(r.op, tuple(r.ranks), r.payload_bytes) for r in log.records]


def test_traced_launch_returns_results_and_a_trace_equal_to_the_comm_log():
    results, run = traced_launch(_talk, 2, quiet=True)
    assert [r[0] for r in results] == [0, 10]                  # the results as without tracing
    assert isinstance(run, trace.Trace) and run.world_size == 2 and run.meta["world_size"] == 2
    for rank, (_, logged) in enumerate(results):
        events = run.ranks[rank]
        assert events.rank == rank
        assert [(c.op, c.ranks, c.bytes) for c in events.comms()] == logged and len(logged) == 4
        assert [c.async_ for c in events.comms()] == [False, False, True, False]
        assert any(isinstance(e, trace.Compute) for e in events.events)
    assert trace.Trace.from_dict(run.to_dict()).to_dict() == run.to_dict()


def test_untraced_launch_unchanged_and_nested_launches_recorded():
    plain = launch(_talk, 2, quiet=True)
    assert [r[0] for r in plain] == [0, 10]                    # no (results, trace) pair from launch itself
    with recording_launches() as outer:
        with recording_launches() as inner:
            launch(_talk, 2, quiet=True)
        results, run = traced_launch(_talk, 2, quiet=True)
    assert len(inner) == 1 and len(outer) == 2 and outer[1] is run and outer[0] is inner[0]
    assert [c.op for c in outer[0].ranks[1].comms()] == ["all_reduce", "all_gather", "all_reduce",
                                                          "recv"]
    launch(_talk, 2, quiet=True)
    assert len(outer) == 2                                     # the block closed: nothing more recorded


def test_tour_trace_option_saves_one_loadable_trace_per_row(tmp_path, capsys):
    from minipar.course.tour import main, trace_file_name
    name = "matmul row split"                                  # the row's name in STRATEGIES (what -k selects)
    assert main(["-k", "matmul row split", "--trace", str(tmp_path)]) == 0
    path = tmp_path / trace_file_name(name)
    assert [p.name for p in tmp_path.iterdir()] == [path.name] == ["matmul_row_split.json"]
    saved = trace.load(path)
    assert saved.world_size == 4 and saved.meta["strategy"] == name and saved.meta["launches"] >= 1
    assert all(r.comms() for r in saved.ranks) and "rank 3:" in str(saved)
    assert "matmul row split (8x8·8x16)" in capsys.readouterr().out   # the table, as without --trace
    assert trace_file_name("tensor parallel + sequence parallel") == "tensor_parallel_+_sequence_parallel.json"

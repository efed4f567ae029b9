"""minipar.comm: wrappers equal torch.distributed, the log counts the right bytes, rings from send/recv."""
import pytest
import torch
import torch.distributed as dist

from minipar import comm, launch


def _collectives(rank, world_size):
    """Every wrapper once on a 2-float-per-rank payload; results and log records returned for checking."""
    n = world_size
    x = torch.arange(4 * n, dtype=torch.float32) + 100 * rank        # divisible by n
    out = {}
    with comm.recording() as log:
        out["all_reduce"] = comm.all_reduce(x.clone())
        parts = [torch.empty_like(x) for _ in range(n)]
        out["all_gather"] = torch.cat(comm.all_gather(parts, x))
        out["reduce_scatter"] = comm.reduce_scatter(torch.empty(4), list(x.clone().chunk(n)))
        out["reduce_scatter_tensor"] = comm.reduce_scatter_tensor(torch.empty(4), x.clone())
        out["all_gather_into_tensor"] = comm.all_gather_into_tensor(torch.empty(4 * n * n), x)
        recv = [torch.empty(4) for _ in range(n)]
        out["all_to_all"] = torch.cat(comm.all_to_all(recv, list(x.clone().chunk(n))))
        out["broadcast"] = comm.broadcast(x.clone(), src=1)
        out["scatter"] = comm.scatter(torch.empty(4), list(x.clone().chunk(n)) if rank == 0 else None, src=0)
        gathered = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
        g = comm.gather(x, gathered, dst=0)
        out["gather"] = torch.cat(g) if rank == 0 else None
        out["reduce"] = comm.reduce(x.clone(), dst=0) if True else None
        out["ring_all_reduce"] = comm.ring_all_reduce(x.clone().view(2, -1))
        out["ring_all_gather"] = comm.ring_all_gather(x.clone())
        out["ring_reduce_scatter"] = comm.ring_reduce_scatter(x.clone())
    return out, [(r.op, r.group_size, r.payload_bytes, r.sent_bytes, r.recv_bytes) for r in log.records]


@pytest.fixture(scope="module")
def four_ranks():
    return launch(_collectives, 4)


def _inputs(n):
    return [torch.arange(4 * n, dtype=torch.float32) + 100 * r for r in range(n)]


def test_collective_results_equal_their_definitions(four_ranks):
    n = 4
    xs = _inputs(n)
    total = sum(xs)
    for rank, (out, _) in enumerate(four_ranks):
        assert torch.equal(out["all_reduce"], total)
        assert torch.equal(out["all_gather"], torch.cat(xs))
        assert torch.equal(out["all_gather_into_tensor"], torch.cat(xs))
        assert torch.equal(out["reduce_scatter"], total.chunk(n)[rank])
        assert torch.equal(out["reduce_scatter_tensor"], total.chunk(n)[rank])
        assert torch.equal(out["all_to_all"], torch.cat([x.chunk(n)[rank] for x in xs]))
        assert torch.equal(out["broadcast"], xs[1])
        assert torch.equal(out["scatter"], xs[0].chunk(n)[rank])
        if rank == 0:
            assert torch.equal(out["gather"], torch.cat(xs))
            assert torch.equal(out["reduce"], total)


def test_rings_built_from_send_recv_equal_the_collectives(four_ranks):
    n = 4
    xs = _inputs(n)
    total = sum(xs)
    for rank, (out, _) in enumerate(four_ranks):
        assert torch.equal(out["ring_all_reduce"], total.view(2, -1))
        assert torch.equal(out["ring_all_gather"], torch.cat(xs))
        assert torch.equal(out["ring_reduce_scatter"], total.chunk(n)[rank])


def test_logged_bytes_follow_the_ring_and_direct_formulas(four_ranks):
    n, s = 4, 4 * 4 * 4                                             # 16 floats of 4 bytes per rank
    for rank, (_, records) in enumerate(four_ranks):
        by_op = {}
        for op, size, payload, sent, recv in records:
            by_op.setdefault(op, []).append((size, payload, sent, recv))
        assert by_op["all_reduce"][0] == (n, s, 2 * (n - 1) / n * s, 2 * (n - 1) / n * s)
        assert by_op["all_gather"][0][2] == (n - 1) / n * (n * s)      # payload = the gathered whole
        assert by_op["reduce_scatter"][0][2] == (n - 1) / n * s
        assert by_op["broadcast"][0][2] == ((n - 1) * s if rank == 1 else 0)
        assert by_op["reduce"][0][2] == (0 if rank == 0 else s)


def test_ring_bytes_are_counted_as_sent_and_equal_the_formula(four_ranks):
    """The hand-written rings log every send: all-reduce 2(N-1)/N·S, all-gather and reduce-scatter
    (N-1)/N·S, where S is the payload (the whole tensor for all-reduce and reduce-scatter, the gathered
    whole for all-gather)."""
    n, s = 4, 64
    for _, records in four_ranks:
        sends = [r[3] for r in records if r[0] == "send"]
        # ring_all_reduce: 2(N-1) sends; ring_all_gather: N-1; ring_reduce_scatter: N-1 (in that order)
        assert len(sends) == 4 * (n - 1)
        assert sum(sends[: 2 * (n - 1)]) == 2 * (n - 1) / n * s
        assert sum(sends[2 * (n - 1): 3 * (n - 1)]) == (n - 1) / n * (n * s)
        assert sum(sends[3 * (n - 1):]) == (n - 1) / n * s


def _ring_sizes(rank, world_size, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    ref = x.clone()
    dist.all_reduce(ref)
    with comm.recording() as log:
        mine = comm.ring_all_reduce(x.clone())
    return torch.allclose(mine, ref, atol=1e-6), log.bytes_sent


@pytest.mark.parametrize("world_size,numel", [(2, 10), (3, 7), (5, 1000)])
def test_ring_all_reduce_any_size(world_size, numel):
    """Uneven sizes are padded to a multiple of N; traffic is 2(N-1)/N of the padded payload."""
    padded = -(-numel // world_size) * world_size
    for ok, sent in launch(_ring_sizes, world_size, numel):
        assert ok
        assert sent == 2 * (world_size - 1) / world_size * padded * 4


def test_records_only_inside_recording_and_nested_logs():
    def fn(rank, world_size):
        t = torch.ones(8)
        comm.all_reduce(t)                                          # not recorded: no log active
        with comm.recording() as outer:
            comm.all_reduce(t)
            with comm.recording() as inner:
                comm.all_reduce(t)
        outer_calls = outer.count()
        outer.reset()
        return outer_calls, inner.count(), outer.count()
    assert launch(fn, 2) == [(2, 1, 0), (2, 1, 0)]


def test_predicted_bytes_for_one_rank_is_zero():
    assert comm.predicted_bytes_sent("all_reduce", 1000, 1) == 0
    assert comm.predicted_bytes_sent("all_reduce", 1000, 4) == 1500

"""minipar.comm: wrappers equal torch.distributed, the log counts the right bytes, rings from send/recv."""
import pytest
import torch
import torch.distributed as dist

from minipar import comm, launch, rings


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


# --- what the sockets carried (minipar.wire), not the log's model: the measurement ----------------------

WIRE_PAYLOAD = 64 * 1024      # bytes: large beside gloo's headers (~150 B a message, ~1.7 KiB a 4-rank all-reduce)
FRAMING = 2048                # allowance per call, bytes


def _one(op, rank, n, x):
    if op == "all_reduce":
        comm.all_reduce(x.clone())
    elif op == "all_gather_into_tensor":
        comm.all_gather_into_tensor(torch.empty(x.numel()), x.chunk(n)[rank].clone())
    elif op == "reduce_scatter_tensor":
        comm.reduce_scatter_tensor(torch.empty(x.numel() // n), x.clone())
    elif op == "all_to_all":
        comm.all_to_all([torch.empty_like(c) for c in x.chunk(n)], [c.clone() for c in x.chunk(n)])
    elif op == "broadcast":
        comm.broadcast(x.clone(), src=0)
    elif op == "scatter":
        comm.scatter(torch.empty(x.numel() // n), [c.clone() for c in x.chunk(n)] if rank == 0 else None, src=0)
    elif op == "gather":
        comm.gather(x.chunk(n)[rank].clone(), [torch.empty(x.numel() // n) for _ in range(n)] if rank == 0 else None, dst=0)
    elif op == "reduce":
        comm.reduce(x.clone(), dst=0)
    elif op == "ring_all_reduce":
        comm.ring_all_reduce(x.clone())
    elif op == "ring_all_gather":
        comm.ring_all_gather(x.chunk(n)[rank].clone())
    elif op == "ring_reduce_scatter":
        comm.ring_reduce_scatter(x.clone())


WIRE_OPS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor":
            "reduce_scatter", "all_to_all": "all_to_all", "broadcast": "broadcast", "scatter": "scatter",
            "gather": "gather", "reduce": "reduce", "ring_all_reduce": "all_reduce",
            "ring_all_gather": "all_gather", "ring_reduce_scatter": "reduce_scatter"}


def _observed(rank, world_size):
    x = torch.randn(WIRE_PAYLOAD // 4, generator=torch.Generator().manual_seed(rank))
    out = {}
    for op in WIRE_OPS:
        with comm.recording() as log:
            _one(op, rank, world_size, x)
        out[op] = (log.observed_bytes_sent, log.bytes_sent, log.count())
    return out


@pytest.mark.skipif(not __import__("minipar.wire", fromlist=["available"]).available(), reason="no /proc/self/io")
def test_observed_bytes_on_the_wire_against_the_formula():
    """Each collective on 4 ranks, 64 KiB: the bytes each rank really wrote to its sockets equal the formula
    (comm.predicted_bytes_sent) plus at most FRAMING bytes per logged call — except where gloo runs another
    algorithm than the textbook one, measured here too: its reduce-scatter all-reduces (2x the ring's
    (N-1)/N·S), its broadcast is a tree (the root sends 2S, rank 1 sends S: the total is the formula's), its
    reduce moves 1.25x the direct model in total."""
    n, s = 4, WIRE_PAYLOAD
    per_rank = launch(_observed, n, quiet=True)
    for op, formula_op in WIRE_OPS.items():
        observed = [r[op][0] for r in per_rank]
        calls = [r[op][2] for r in per_rank]
        formula = [comm.predicted_bytes_sent(formula_op, s, n, is_root=rank == 0) for rank in range(n)]
        assert [r[op][1] for r in per_rank] == formula, op                     # the log's model = the formula
        if op == "reduce_scatter_tensor":
            for o, f, c in zip(observed, formula, calls):
                assert 2 * f <= o <= 2 * f + FRAMING * c, (op, o, f)
        elif op == "reduce":
            assert 1.25 * sum(formula) <= sum(observed) <= 1.25 * sum(formula) + FRAMING * sum(calls), (op, observed)
        elif op == "broadcast":
            assert sum(formula) <= sum(observed) <= sum(formula) + FRAMING * sum(calls), (op, observed)
            assert observed[0] >= 2 * s > formula[0] / 2                        # a tree: not the root alone
        else:
            for o, f, c in zip(observed, formula, calls):
                assert f <= o <= f + FRAMING * c, (op, o, f, c)


# ----------------------------------------------------------------------------------------------------
# comm.ring_algorithms(): one scoped switch from gloo's collectives to minipar's rings
# ----------------------------------------------------------------------------------------------------

def _switched(rank, world_size, ops):
    """The five switchable wrappers inside ``ring_algorithms(*ops)``, and once outside: results, the ops
    the log recorded, its bytes, and the reduce-scatter's bytes on the sockets."""
    n = world_size
    x = torch.arange(WIRE_PAYLOAD // 4, dtype=torch.float32) + 1000 * rank      # divisible by n
    def five():
        out = {"all_reduce": comm.all_reduce(x.clone()),
               "all_gather": torch.cat(comm.all_gather([torch.empty(4) for _ in range(n)], x[:4].clone())),
               "all_gather_into_tensor": comm.all_gather_into_tensor(torch.empty(4 * n), x[:4].clone()),
               "reduce_scatter": comm.reduce_scatter(torch.empty(4), list(x[:4 * n].clone().chunk(n)))}
        with comm.recording() as rs:
            out["reduce_scatter_tensor"] = comm.reduce_scatter_tensor(torch.empty(x.numel() // n), x.clone())
        return out, rs
    with comm.recording() as inside, comm.ring_algorithms(*ops):
        got, rs_in = five()
    with comm.recording() as outside:
        want, rs_out = five()
    return (got, want, sorted({r.op for r in inside.records}), sorted({r.op for r in outside.records}),
            rs_in.bytes_sent, rs_in.observed_bytes_sent, rs_out.observed_bytes_sent, rs_in.count())


def test_ring_algorithms_switch_runs_the_rings_inside_and_gloo_outside():
    """Inside the block every switchable collective is the ring's send/recv messages (same results as gloo,
    the textbook (N-1)/N·S bytes logged and on the wire for reduce-scatter, where gloo sends 2x); after the
    block the same calls are gloo's again."""
    n, s = 4, WIRE_PAYLOAD
    for rank, (got, want, ops_in, ops_out, rs_model, rs_wire_in, rs_wire_out, rs_calls) in \
            enumerate(launch(_switched, n, (), quiet=True)):
        for op in want:
            assert torch.equal(got[op], want[op]), (rank, op)
        assert ops_in == ["recv", "send"]
        assert ops_out == ["all_gather", "all_reduce", "reduce_scatter"]
        assert rs_model == comm.predicted_bytes_sent("reduce_scatter", s, n) and rs_calls == 2 * (n - 1)
        if rs_wire_in is not None:
            assert rs_model <= rs_wire_in <= rs_model + FRAMING * rs_calls, rs_wire_in
            assert rs_wire_out >= 2 * rs_model, rs_wire_out                    # gloo's: an all-reduce inside


def test_ring_algorithms_switches_only_the_named_collectives():
    for got, want, ops_in, _, rs_model, *_ in launch(_switched, 2, ("reduce_scatter",), quiet=True):
        assert ops_in == ["all_gather", "all_reduce", "recv", "send"]         # only the reduce-scatters moved
        assert all(torch.equal(got[op], want[op]) for op in want)


def test_ring_algorithms_rejects_an_unknown_collective_and_is_scoped():
    with pytest.raises(ValueError, match="all_to_all"):
        with comm.ring_algorithms("all_to_all"):
            pass
    with comm.ring_algorithms("all_gather"):
        with comm.ring_algorithms("reduce_scatter"):                           # nested: replaces
            assert rings.on_ring("reduce_scatter") and not rings.on_ring("all_gather")
        assert rings.on_ring("all_gather") and not rings.on_ring("reduce_scatter")
        assert not rings.on_ring("all_gather", async_op=True)
    assert not rings.on_ring("all_gather") and not rings.on_ring("all_reduce")


def test_ring_algorithms_enabled_false_changes_nothing():
    """``enabled=`` makes the switch a flag (no ``... if on else nullcontext()`` at the caller): False leaves
    whatever is in force, inside another block too."""
    with comm.ring_algorithms("all_gather", enabled=False):
        assert not rings.on_ring("all_gather")
    with comm.ring_algorithms("all_gather"):
        with comm.ring_algorithms("reduce_scatter", enabled=False):
            assert rings.on_ring("all_gather") and not rings.on_ring("reduce_scatter")
    with pytest.raises(ValueError, match="all_to_all"):
        with comm.ring_algorithms("all_to_all", enabled=False):
            pass


# ---- every record names its group: ranks, mesh dims, and the bytes a blocking call wrote -----------------

def _tagged(rank, world_size):
    from minipar import Mesh
    rm = Mesh(world_size, dp=2, tp=2).build(rank)
    x = torch.ones(256)
    with comm.recording(mesh=rm) as log:
        comm.all_reduce(x.clone(), group=rm.group("tp"))
        comm.all_reduce(x.clone(), group=rm.group("dp"))
        comm.all_reduce(x.clone(), group=rm.group("dp", "tp"))
        comm.all_reduce(x.clone())                                    # the world: spans every dim
        peer = rm.rank_at(dp=1 - rm.coord("dp"))
        comm.ring_exchange(x, torch.empty_like(x), peer, peer)       # a p2p pair across dp
    with comm.recording() as plain:                                   # no mesh: dims unknown until one is given
        comm.all_reduce(x.clone(), group=rm.group("tp"))
    untagged = plain.records[0].dims
    try:
        plain.bytes_by_dims()
        refused = None
    except ValueError as e:
        refused = str(e)
    return ([(r.op, r.ranks, r.dims, r.sent_bytes, r.observed_sent) for r in log.records], log.bytes_by_dims(),
            log.bytes_sent, plain.bytes_by_dims(mesh=rm), untagged, refused,
            log.select(op="all_reduce", dims=("dp",)).bytes_sent)


def test_records_carry_their_group_and_the_dims_it_spans():
    from minipar import Mesh
    mesh = Mesh(4, dp=2, tp=2)
    s = 256 * 4
    ring = 2 * (2 - 1) / 2 * s
    for rank, (records, by_dims, total, plain, untagged, refused, dp_bytes) in enumerate(
            launch(_tagged, 4, quiet=True)):
        ops = [(op, ranks, dims) for op, ranks, dims, _, _ in records]
        peer = mesh.rank_at(rank, dp=1 - mesh.coords(rank)["dp"])
        pair = tuple(sorted((rank, peer)))
        assert ops == [("all_reduce", tuple(mesh.group_ranks("tp", rank)), ("tp",)),
                       ("all_reduce", tuple(mesh.group_ranks("dp", rank)), ("dp",)),
                       ("all_reduce", (0, 1, 2, 3), ("dp", "tp")),
                       ("all_reduce", (0, 1, 2, 3), ("dp", "tp")),
                       ("send", pair, ("dp",)), ("recv", pair, ("dp",))]
        assert by_dims == {("tp",): ring, ("dp",): ring + s, ("dp", "tp"): 2 * (2 * 3 / 4 * s)}
        assert sum(by_dims.values()) == total and dp_bytes == ring
        assert plain == {("tp",): ring} and untagged is None and "mesh" in refused
        for op, _, _, sent, observed in records:
            if op == "send":                       # async: its bytes leave after the call returns
                assert observed is None
            elif observed is not None:             # blocking: at least the model (+ gloo's framing)
                assert sent <= observed <= sent + 4096

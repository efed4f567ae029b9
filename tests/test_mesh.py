"""minipar.mesh: every group has the right members, bad shapes are refused, groups really work."""
import itertools
import math

import pytest
import torch
import torch.distributed as dist

from minipar import Mesh, RankMesh, launch


def test_8_ranks_dp2_pp2_tp2():
    mesh = Mesh(8, dp=2, pp=2, tp=2)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.coords(5) == {"dp": 1, "pp": 0, "cp": 0, "ep": 0, "tp": 1}
    assert mesh.group_ranks("pp", 5) == [5, 7]


def test_4_ranks_dp1_pp2_tp2():
    mesh = Mesh(4, dp=1, pp=2, tp=2)
    assert mesh.groups("tp") == [[0, 1], [2, 3]]
    assert mesh.groups("pp") == [[0, 2], [1, 3]]
    assert mesh.groups("dp") == [[0], [1], [2], [3]]


@pytest.mark.parametrize("world,sizes", [(8, dict(dp=2, pp=2, tp=2)), (4, dict(dp=1, pp=2, tp=2)),
                                         (12, dict(dp=3, pp=2, tp=2)), (8, dict(dp=2, cp=2, ep=2)),
                                         (6, dict(pp=3, tp=2))])
def test_groups_partition_the_world_along_every_dim(world, sizes):
    mesh = Mesh(world, **sizes)
    for dim in mesh.dims:
        groups = mesh.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(world))
        for g in groups:
            assert len(g) == mesh.size(dim)
            coords = [mesh.coords(r) for r in g]
            # members differ only along `dim`, and are ordered by their coordinate along it
            assert [c[dim] for c in coords] == list(range(mesh.size(dim)))
            for other in mesh.dims:
                if other != dim:
                    assert len({c[other] for c in coords}) == 1


def test_sizes_must_multiply_to_world_size():
    with pytest.raises(ValueError, match="has 6 ranks but world_size is 8"):
        Mesh(8, dp=3, tp=2)
    with pytest.raises(ValueError, match="unknown mesh dimension"):
        Mesh(4, xp=4)
    with pytest.raises(ValueError, match="positive integer"):
        Mesh(4, tp=0)


def _mesh_on_ranks(rank, world_size):
    rm = Mesh(world_size, dp=2, pp=2, tp=2).build(rank)
    out = {}
    for dim in ("dp", "pp", "tp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=rm.group(dim))
        out[dim] = t.item()
    return out, rm.ranks("tp"), rm.pp_prev, rm.pp_next, rm.is_first_stage, rm.is_last_stage


def test_built_groups_reduce_over_their_members():
    mesh = Mesh(8, dp=2, pp=2, tp=2)
    for rank, (sums, tp_ranks, prev, nxt, first, last) in enumerate(launch(_mesh_on_ranks, 8)):
        for dim in ("dp", "pp", "tp"):
            assert sums[dim] == sum(mesh.group_ranks(dim, rank))
        assert tp_ranks == mesh.group_ranks("tp", rank)
        stage = mesh.coords(rank)["pp"]
        pp = mesh.group_ranks("pp", rank)
        assert (prev, nxt) == ((None, pp[1]) if stage == 0 else (pp[0], None))
        assert (first, last) == (stage == 0, stage == 1)


# ---- groups over any set of dimensions, against a brute-force enumeration ---------------------------------

FIVE = ("a", "b", "c", "d", "e")


def _brute_force(sizes: dict):
    """{rank: coords} by counting in row-major order (last dim fastest), with no tensor arithmetic."""
    return {r: dict(zip(sizes, c)) for r, c in enumerate(itertools.product(*(range(s) for s in sizes.values())))}


def _brute_group(coords: dict, rank: int, dims) -> list:
    return [r for r, c in coords.items() if all(c[d] == coords[rank][d] for d in coords[rank] if d not in dims)]


@pytest.mark.parametrize("sizes", [dict(a=2, b=2, c=2, d=2, e=2), dict(a=3, b=2, c=1, d=2, e=2)])
def test_every_group_over_one_two_and_three_of_five_dims_equals_brute_force(sizes):
    world = math.prod(sizes.values())
    mesh = Mesh(world, order=FIVE, **sizes)
    coords = _brute_force(sizes)
    assert all(mesh.coords(r) == c and mesh.rank_of(c) == r for r, c in coords.items())
    checked = 0
    for n in (1, 2, 3):
        for dims in itertools.combinations(FIVE, n):
            want = {tuple(_brute_group(coords, r, dims)) for r in coords}
            assert sorted(map(tuple, mesh.groups(*dims))) == sorted(want)
            shuffled = tuple(reversed(dims))                  # the order the caller names them does not matter
            for r in coords:
                assert mesh.group_ranks(shuffled, r) == _brute_group(coords, r, dims)
            varying = tuple(d for d in FIVE if d in dims and sizes[d] > 1)
            assert all(mesh.dims_spanned(g) == varying for g in want)
            assert mesh.key(dims) == varying and mesh.size(*dims) == len(next(iter(want)))
            checked += 1
    assert checked == 5 + 10 + 10


def test_groups_are_listed_in_mesh_order_last_dim_fastest():
    mesh = Mesh(8, dp=2, pp=2, tp=2)
    assert mesh.groups("dp", "tp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert mesh.groups("tp", "dp") == mesh.groups("dp", "tp")
    assert mesh.groups("dp", "pp", "tp") == [list(range(8))]
    assert mesh.groups() == [[r] for r in range(8)]
    assert mesh.rank_at(5, pp=1) == 7 and mesh.dims_spanned([5]) == () and mesh.dims_spanned([0, 7]) == ("dp", "pp", "tp")
    assert mesh.combinations() == [(), ("dp",), ("pp",), ("tp",), ("dp", "pp"), ("dp", "tp"), ("pp", "tp"),
                                   ("dp", "pp", "tp")]


def test_node_placement():
    mesh = Mesh(16, dp=2, pp=2, tp=4, devices_per_node=8)
    assert [mesh.node_of(r) for r in range(16)] == [0] * 8 + [1] * 8
    crossing = {dims: [mesh.crosses_nodes(g) for g in mesh.groups(*dims)] for dims in (("tp",), ("pp",), ("dp",),
                                                                                       ("pp", "tp"))}
    assert crossing == {("tp",): [False] * 4, ("pp",): [False] * 8, ("dp",): [True] * 8, ("pp", "tp"): [False] * 2}
    one_node = Mesh(16, dp=2, pp=2, tp=4)
    assert not any(one_node.crosses_nodes(g) for g in one_node.groups("dp"))
    with pytest.raises(ValueError, match="devices_per_node"):
        Mesh(8, tp=8, devices_per_node=0)


def test_unknown_dims_and_missing_groups_are_named():
    mesh = Mesh(8, dp=2, pp=2, tp=2)
    with pytest.raises(ValueError, match="unknown mesh dimension"):
        mesh.group_ranks(("dp", "xp"), 0)
    with pytest.raises(ValueError, match="rank 8"):
        mesh.coords(8)
    view = RankMesh(mesh, 0, {("dp",): "dp group"})
    assert view.group("dp", "cp") == "dp group"                       # cp has size 1: the same members
    with pytest.raises(ValueError, match=r"combos=\[\('dp', 'tp'\)\]"):
        view.group("tp", "dp")


def _combos_on_ranks(rank, world_size):
    import time
    t0 = time.perf_counter()
    rm = Mesh(world_size, dp=2, pp=2, tp=2).build(rank)
    seconds = time.perf_counter() - t0
    sums = {}
    for dims in Mesh(world_size, dp=2, pp=2, tp=2).combinations():
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=rm.group(*dims))
        sums[dims] = (t.item(), rm.ranks(*dims), dist.get_process_group_ranks(rm.group(*dims)))
    few = Mesh(world_size, dp=2, pp=2, tp=2).build(rank, combos=[("dp", "tp")])
    try:
        few.group("pp", "tp")
        missing = None
    except ValueError as e:
        missing = str(e)
    return sums, rm.coords, seconds, missing


def test_groups_over_several_dims_reduce_over_their_members():
    mesh = Mesh(8, dp=2, pp=2, tp=2)
    for rank, (sums, coords, _, missing) in enumerate(launch(_combos_on_ranks, 8, quiet=True)):
        assert coords == mesh.coords(rank)
        for dims, (total, ranks, members) in sums.items():
            assert ranks == members == mesh.group_ranks(dims, rank)
            assert total == sum(ranks)
        assert "combos=[('pp', 'tp')]" in missing

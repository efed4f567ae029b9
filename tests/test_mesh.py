"""minipar.mesh: every group has the right members, bad shapes are refused, groups really work."""
import pytest
import torch
import torch.distributed as dist

from minipar import Mesh, launch


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

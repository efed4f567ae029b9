"""Grids for 2D / 2.5D / 3D tensor parallelism: layouts from the mesh, bad sizes refused before any process."""
import pytest
import torch.distributed as dist

from minipar import launch
from minipar.tensor.grid import build, grid_2d, grid_2p5d, grid_3d


def test_layouts():
    assert grid_2d(4).grid.tolist() == [[0, 1], [2, 3]]
    assert grid_2d(9).groups("j") == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]     # block rows
    assert grid_2d(9).groups("i") == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]     # block columns
    m = grid_2p5d(8, depth=2)
    assert m.groups("k") == [[0, 4], [1, 5], [2, 6], [3, 7]]               # depth groups: same (i, j)
    assert m.group_ranks("j", 5) == [4, 5]
    assert grid_2p5d(18, depth=2).size("i") == 3
    c = grid_3d(8)
    assert c.groups("x") == [[0, 4], [1, 5], [2, 6], [3, 7]] and c.groups("z") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid_3d(27).size("z") == 3 and grid_3d(1).size("x") == 1


@pytest.mark.parametrize("make, bad, words", [
    (grid_2d, 8, "square"), (grid_2d, 2, "square"), (grid_3d, 4, "cube"), (grid_3d, 9, "cube"),
    (lambda n: grid_2p5d(n, depth=2), 12, "not a square"), (lambda n: grid_2p5d(n, depth=3), 8, "divide"),
    (lambda n: grid_2p5d(n, depth=0), 8, "depth"), (grid_2d, 0, "positive")])
def test_bad_sizes_refused(make, bad, words):
    with pytest.raises(ValueError, match=words):
        make(bad)


def _groups(rank, world_size):
    g = build(grid_3d(world_size), rank)
    lines = {d: dist.get_process_group_ranks(g.group(d)) for d in "xyz"}
    planes = {d: sorted(dist.get_process_group_ranks(g.plane(d))) for d in "xyz"}
    return lines, planes, g.rank_at(x=0, y=0), g.coord("y")


def test_groups_on_ranks():
    out = launch(_groups, 8, quiet=True)
    lines, planes, r00, y = out[5]                 # rank 5 = (x=1, y=0, z=1)
    assert lines == {"x": [1, 5], "y": [5, 7], "z": [4, 5]}
    assert planes == {"x": [4, 5, 6, 7], "y": [0, 1, 4, 5], "z": [1, 3, 5, 7]}
    assert r00 == 1 and y == 0

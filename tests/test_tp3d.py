"""3D (cube) tensor parallelism: pieces forward and backward equal the dense computation; two layers chain."""
import torch
import torch.nn as nn

from minipar import comm, launch
from minipar.tensor import tp3d
from minipar.tensor.grid import build, grid_3d

Q = 2


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in ((8, 12), (12, 6), (8, 6))]


def _cube(rank, world_size):
    g = build(grid_3d(world_size), rank)
    m, k, n = (g.coord(d) for d in tp3d.roles(0))
    x, a, dy = _data()
    xp = tp3d.piece(x, m, k, n, Q).requires_grad_(True)
    ap = tp3d.piece(a, k, n, m, Q).requires_grad_(True)
    tp3d.Cube.apply(xp, ap, g, tp3d.roles(0)).sum().backward()     # warm-up: gloo connects pairs on first use
    xp.grad = ap.grad = None
    with comm.recording() as fwd:
        y = tp3d.Cube.apply(xp, ap, g, tp3d.roles(0))
    with comm.recording() as bwd:
        y.backward(tp3d.piece(dy, m, n, k, Q))
    return (m, k, n), y.detach(), xp.grad, ap.grad, fwd, bwd


def test_cube_forward_backward_equal_dense():
    x, a, dy = _data()
    xf, af = x.clone().requires_grad_(True), a.clone().requires_grad_(True)
    (xf @ af).backward(dy)
    for (m, k, n), y, dx, da, fwd, bwd in launch(_cube, 8, quiet=True):
        torch.testing.assert_close(y, tp3d.piece(x @ a, m, n, k, Q), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dx, tp3d.piece(xf.grad, m, k, n, Q), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(da, tp3d.piece(af.grad, k, n, m, Q), rtol=1e-12, atol=1e-12)
        assert [r.op for r in fwd.records if r.op != "recv"][:2] == ["all_gather", "all_gather"]
        want = tp3d.bytes_per_linear(8, 12, 6, Q, value_bytes=8)
        assert (fwd.bytes_sent, bwd.bytes_sent) == (want["forward"], want["backward"])
        for log in (fwd, bwd):                                # the wire: the model + a header per message
            assert log.bytes_sent <= log.observed_bytes_sent < log.bytes_sent + 300 * log.count()


def _two_layers(rank, world_size):
    g = build(grid_3d(world_size), rank)
    torch.manual_seed(0)
    l0, l1 = nn.Linear(12, 8).double(), nn.Linear(8, 4).double()
    x, _, _ = _data()
    m, k, n = (g.coord(d) for d in tp3d.roles(0))
    a, b = tp3d.Linear3D(l0, g, 0), tp3d.Linear3D(l1, g, 1)
    xp = tp3d.piece(x, m, k, n, Q).requires_grad_(True)
    y = b(torch.tanh(a(xp)))
    y.pow(2).sum().backward()
    for layer in (a, b):
        layer.sync_grads()
    m1, k1, n1 = (g.coord(d) for d in tp3d.roles(1))
    return (m1, k1, n1), y.detach(), xp.grad, a.bias.grad, b.bias.grad, a.full_weight(), b.full_bias()


def test_layers_chain_without_relayout():
    torch.manual_seed(0)
    l0, l1 = nn.Linear(12, 8).double(), nn.Linear(8, 4).double()
    x, _, _ = _data()
    xf = x.clone().requires_grad_(True)
    y = l1(torch.tanh(l0(xf)))
    y.pow(2).sum().backward()
    for rank, ((m, k, n), yp, dx, db0, db1, w0, b1) in enumerate(launch(_two_layers, 8, quiet=True)):
        close = lambda got, want: torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)  # noqa: E731
        close(yp, tp3d.piece(y.detach(), m, n, k, Q))          # layer 1's roles: output Y_mn piece k
        c = grid_3d(8).coords(rank)
        close(dx, tp3d.piece(xf.grad, c["x"], c["y"], c["z"], Q))
        close(db0, l0.bias.grad.chunk(Q)[c["z"]])
        close(db1, l1.bias.grad.chunk(Q)[c["y"]])
        close(w0, l0.weight.detach()), close(b1, l1.bias.detach())


def test_mlp_trains_like_one_device_and_bytes_measured():
    from minipar.check import mlp_recipe
    from minipar.tensor import multidim_measure as mmeasure
    from minipar.tensor import multidim_mlp as mm
    mm.run(mm.in_dtype(mlp_recipe(steps=3, optimizer="adam")), world_size=8, layout="3d",
           launch_kwargs={"quiet": True}).assert_ok()
    c = mmeasure.counts("3d", 8)
    for r in mmeasure.measure_all(8, "3d"):
        assert r["bytes_model"] == c["bytes"] and r["messages"] == c["messages"]
        assert r["bytes_model"] < r["bytes_observed"] <= r["bytes_model"] + 300 * r["messages"]
        assert r["params"] == (32 * 128 * 2) * 4 / 8          # 1/q³ of the weights


def test_cube_refuses_non_cubes():
    import pytest
    from minipar.check import mlp_recipe
    from minipar.tensor import multidim_mlp as mm
    with pytest.raises(ValueError, match="cube"):
        mm.run(mlp_recipe(steps=1), world_size=4, layout="3d")
    with pytest.raises(ValueError, match="divide by 4"):
        mm.run(mlp_recipe(steps=1, sizes=(16, 66, 8)), world_size=8, layout="3d")

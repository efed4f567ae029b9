"""2D (SUMMA) tensor parallelism: blocks forward and backward equal the dense computation."""
import torch
import torch.nn as nn

from minipar import comm, launch
from minipar.tensor import tp2d
from minipar.tensor.grid import build, grid_2d


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(8, 12, generator=g, dtype=torch.float64), torch.randn(12, 6, generator=g, dtype=torch.float64),
            torch.randn(8, 6, generator=g, dtype=torch.float64))


def _summa(rank, world_size):
    g = build(grid_2d(world_size), rank)
    q, i, j = g.size("i"), g.coord("i"), g.coord("j")
    x, a, dy = _data()
    xb, ab = tp2d.block(x, i, j, q).requires_grad_(True), tp2d.block(a, i, j, q).requires_grad_(True)
    tp2d.Summa.apply(xb, ab, g).sum().backward()            # warm-up: gloo connects pairs on first use
    xb.grad = ab.grad = None
    with comm.recording() as fwd:
        y = tp2d.Summa.apply(xb, ab, g)
    with comm.recording() as bwd:
        y.backward(tp2d.block(dy, i, j, q))
    return y.detach(), xb.grad, ab.grad, fwd.bytes_sent, bwd.bytes_sent, (fwd, bwd)


def test_summa_forward_backward_equal_dense():
    x, a, dy = _data()
    xf, af = x.clone().requires_grad_(True), a.clone().requires_grad_(True)
    (xf @ af).backward(dy)
    q = 2
    if True:
        out = launch(_summa, 4, quiet=True)
        for rank, (y, dx, da, fwd, bwd, seen) in enumerate(out):
            i, j = divmod(rank, q)
            torch.testing.assert_close(y, tp2d.block(x @ a, i, j, q), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(dx, tp2d.block(xf.grad, i, j, q), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(da, tp2d.block(af.grad, i, j, q), rtol=1e-12, atol=1e-12)
            want = tp2d.bytes_per_linear(8, 12, 6, q, value_bytes=8)
            assert (fwd, bwd) == (want["forward"], want["backward"])
            for log in seen:                                   # the wire: the model + a header per message
                assert log.bytes_sent <= log.observed_bytes_sent < log.bytes_sent + 300 * log.count()


def _summa_3x3(rank, world_size):
    g = build(grid_2d(world_size), rank)
    x, a, dy = _data(1)
    xb = tp2d.block(torch.cat([x, x[:1]]), g.coord("i"), g.coord("j"), 3)
    return tp2d.summa(xb, tp2d.block(a, g.coord("i"), g.coord("j"), 3), g)


def test_summa_on_3x3():
    x, a, _ = _data(1)
    x = torch.cat([x, x[:1]])                              # 9 rows
    for rank, y in enumerate(launch(_summa_3x3, 9, quiet=True, timeout=60)):
        torch.testing.assert_close(y, tp2d.block(x @ a, *divmod(rank, 3), 3), rtol=1e-12, atol=1e-12)


def _layers(rank, world_size):
    g = build(grid_2d(world_size), rank)
    q, i, j = 2, g.coord("i"), g.coord("j")
    torch.manual_seed(0)
    lin, ln = nn.Linear(12, 6).double(), nn.LayerNorm(6).double()
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5), ln.bias.uniform_(-1, 1)
    x, _, dy = _data()
    lin2, ln2 = tp2d.Linear2D(lin, g), tp2d.LayerNorm2D(ln, g)
    xb = tp2d.block(x, i, j, q).requires_grad_(True)
    y = ln2(lin2(xb))
    y.backward(tp2d.block(dy, i, j, q))
    for m in (lin2, ln2):
        m.sync_grads()
    return (y.detach(), xb.grad, lin2.bias.grad, ln2.weight.grad, ln2.bias.grad, lin2.full_weight(), lin2.full_bias())


def test_linear_and_layernorm_2d():
    torch.manual_seed(0)
    lin, ln = nn.Linear(12, 6).double(), nn.LayerNorm(6).double()
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5), ln.bias.uniform_(-1, 1)
    x, _, dy = _data()
    xf = x.clone().requires_grad_(True)
    y = ln(lin(xf))
    y.backward(dy)
    for rank, (yb, dx, db, dg, dbeta, w, b) in enumerate(launch(_layers, 4, quiet=True)):
        i, j = divmod(rank, 2)
        close = lambda got, want: torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)  # noqa: E731
        close(yb, tp2d.block(y.detach(), i, j, 2))
        close(dx, tp2d.block(xf.grad, i, j, 2))
        close(db, lin.bias.grad.chunk(2)[j])
        close(dg, ln.weight.grad.chunk(2)[j])
        close(dbeta, ln.bias.grad.chunk(2)[j])
        close(w, lin.weight.detach()), close(b, lin.bias.detach())


def test_mlp_trains_like_one_device():
    from minipar.check import mlp_recipe
    from minipar.tensor import multidim_mlp as mm
    for optimizer in ("sgd", "adam"):
        recipe = mm.in_dtype(mlp_recipe(steps=3, optimizer=optimizer))
        mm.run(recipe, world_size=4, layout="2d", launch_kwargs={"quiet": True}).assert_ok()


def test_mlp_refused_before_any_process():
    import pytest
    from minipar.check import mlp_recipe
    from minipar.tensor import multidim_mlp as mm
    with pytest.raises(ValueError, match="square"):
        mm.run(mlp_recipe(steps=1), world_size=8, layout="2d")
    with pytest.raises(ValueError, match="divide by 2"):
        mm.run(mlp_recipe(steps=1, sizes=(16, 63, 8)), world_size=4, layout="2d")
    with pytest.raises(ValueError, match="rows"):
        mm.run(mlp_recipe(steps=1, batch_size=6), world_size=16, layout="2d")
    with pytest.raises(ValueError, match="unknown layout"):
        mm.run(mlp_recipe(steps=1), world_size=4, layout="4d")


def test_1d_baseline_trains_like_one_device():
    from minipar.check import mlp_recipe
    from minipar.tensor import multidim_mlp as mm
    mm.run(mm.in_dtype(mlp_recipe(steps=3, optimizer="adam")), world_size=4, layout="1d",
           launch_kwargs={"quiet": True}).assert_ok()


def test_measured_bytes_and_messages_equal_the_closed_forms():
    """The comparison's numbers: the log's model = the formula; the sockets = model + a header per message."""
    from minipar.tensor import multidim_measure as mmeasure
    for layout, world in (("1d", 4), ("2d", 4)):
        c = mmeasure.counts(layout, world)
        for r in mmeasure.measure_all(world, layout):
            assert r["bytes_model"] == c["bytes"] and r["messages"] == c["messages"]
            assert r["bytes_model"] < r["bytes_observed"] <= r["bytes_model"] + 300 * r["messages"]

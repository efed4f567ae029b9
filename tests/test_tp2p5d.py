"""2.5D (Tesseract) tensor parallelism on 2 stacked 2×2 layers: equal to dense only with the depth sum."""
import torch
import torch.nn as nn

from minipar import launch
from minipar.tensor import tp2p5d
from minipar.tensor.grid import build, grid_2p5d

Q, D = 2, 2


def _linear(rank, world_size, depth_sum):
    g = build(grid_2p5d(world_size, D), rank)
    k, i, j = g.coord("k"), g.coord("i"), g.coord("j")
    torch.manual_seed(0)
    lin = nn.Linear(12, 6).double()
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    layer = tp2p5d.Linear2p5D(lin, g)
    xb = tp2p5d.x_block(x, k, i, j, Q, D).requires_grad_(True)
    y = layer(xb)
    y.pow(2).sum().backward()
    layer.sync_grads(depth=depth_sum)
    return (k, i, j), y.detach(), xb.grad, layer.weight.grad, layer.bias.grad


def _dense():
    torch.manual_seed(0)
    lin = nn.Linear(12, 6).double()
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_(True)
    y = lin(x)
    y.pow(2).sum().backward()
    return lin, x, y.detach()


def test_tesseract_equals_dense_with_depth_sum():
    lin, x, y = _dense()
    for (k, i, j), yb, dx, dw, db in launch(_linear, 8, True, quiet=True):
        close = lambda got, want: torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)  # noqa: E731
        close(yb, tp2p5d.x_block(y, k, i, j, Q, D))
        close(dx, tp2p5d.x_block(x.grad, k, i, j, Q, D))
        close(dw, tp2p5d.block(lin.weight.grad.T, i, j, Q))       # every depth replica: the whole sum
        close(db, lin.bias.grad.chunk(Q)[j])


def test_without_depth_sum_each_layer_sees_only_its_tokens():
    """The derivation: each layer's SUMMA gradient is the gradient of its own 1/d of the tokens; the d
    partials add up to the dense gradient, and no single one equals it."""
    lin, x, _ = _dense()
    out = launch(_linear, 8, False, quiet=True)
    by_block = {}
    for (k, i, j), _, _, dw, _ in out:
        by_block.setdefault((i, j), []).append((k, dw))
    for (i, j), parts in by_block.items():
        want = tp2p5d.block(lin.weight.grad.T, i, j, Q)
        assert not any(torch.allclose(dw, want) for _, dw in parts)
        torch.testing.assert_close(sum(dw for _, dw in parts), want, rtol=1e-10, atol=1e-12)
        for k, dw in parts:                                    # layer k's partial = gradient of its tokens
            xs = x.detach().chunk(D)[k]
            ys = lin(xs)
            local = torch.autograd.grad(ys.pow(2).sum(), lin.weight)[0]
            torch.testing.assert_close(dw, tp2p5d.block(local.T, i, j, Q), rtol=1e-10, atol=1e-12)


def test_mlp_trains_like_one_device_and_bytes_measured():
    from minipar.check import mlp_recipe
    from minipar.tensor import multidim_measure as mmeasure
    from minipar.tensor import multidim_mlp as mm
    mm.run(mm.in_dtype(mlp_recipe(steps=3, optimizer="adam")), world_size=8, layout="2.5d", depth=2,
           launch_kwargs={"quiet": True}).assert_ok()
    c = mmeasure.counts("2.5d", 8)
    for r in mmeasure.measure_all(8, "2.5d"):
        assert r["bytes_model"] == c["bytes"] and r["messages"] == c["messages"]
        assert r["bytes_model"] < r["bytes_observed"] <= r["bytes_model"] + 300 * r["messages"]
        assert r["params"] == (32 * 128 * 2) * 4 / 4          # 1/q²: the weights are replicated over depth


def test_refused_before_any_process():
    import pytest
    from minipar.check import mlp_recipe
    from minipar.tensor import multidim_mlp as mm
    with pytest.raises(ValueError, match="not a square"):
        mm.run(mlp_recipe(steps=1), world_size=12, layout="2.5d", depth=2)
    with pytest.raises(ValueError, match="rows"):
        mm.run(mlp_recipe(steps=1, batch_size=6), world_size=8, layout="2.5d", depth=2)


def _layernorm(rank, world_size):
    g = build(grid_2p5d(world_size, D), rank)
    k, i, j = g.coord("k"), g.coord("i"), g.coord("j")
    torch.manual_seed(0)
    lin, ln = nn.Linear(12, 6).double(), nn.LayerNorm(6).double()
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lin2, ln2 = tp2p5d.Linear2p5D(lin, g), tp2p5d.LayerNorm2p5D(ln, g)
    xb = tp2p5d.x_block(x, k, i, j, Q, D).requires_grad_(True)
    y = ln2(lin2(xb))
    y.pow(2).sum().backward()
    lin2.sync_grads(), ln2.sync_grads()
    return (k, i, j), y.detach(), xb.grad, ln2.weight.grad, ln2.bias.grad, lin2.bias.grad


def test_layernorm_and_bias_on_the_stacked_grid():
    torch.manual_seed(0)
    lin, ln = nn.Linear(12, 6).double(), nn.LayerNorm(6).double()
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_(True)
    y = ln(lin(x))
    y.pow(2).sum().backward()
    for (k, i, j), yb, dx, dg, dbeta, db in launch(_layernorm, 8, quiet=True):
        close = lambda got, want: torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)  # noqa: E731
        close(yb, tp2p5d.x_block(y.detach(), k, i, j, Q, D))
        close(dx, tp2p5d.x_block(x.grad, k, i, j, Q, D))
        close(dg, ln.weight.grad.chunk(Q)[j]), close(dbeta, ln.bias.grad.chunk(Q)[j]), close(db, lin.bias.grad.chunk(Q)[j])

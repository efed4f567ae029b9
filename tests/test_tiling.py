"""Memory-centric tiling: the tiled linear equals the untiled one, with far fewer parameter bytes live."""
import pytest
import torch
import torch.nn as nn

from minipar.data.tiling import TiledLinear, tile_bounds


def _layer(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(64, 1000)


def _run(layer, x):
    y = layer(x)
    (y.square().mean()).backward()
    return y.detach(), x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("tiles", [2, 7, 10])
def test_tiled_equals_untiled_forward_and_backward(tiles):
    x = torch.randn(8, 64)
    plain = _run(_layer(), x.clone().requires_grad_())
    tiled_layer = TiledLinear(_layer(), tiles)
    tiled = _run(tiled_layer, x.clone().requires_grad_())
    # Outputs are the same dot products: bit-exact. The gradients are reduced by kernels of another shape
    # (x.grad also adds the tiles' contributions in another order): equal to float32 rounding.
    assert torch.equal(plain[0], tiled[0])
    for got, want in zip(tiled[1:], plain[1:]):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)


def test_peak_live_parameter_bytes_fall_with_the_number_of_tiles():
    x = torch.randn(8, 64, requires_grad=True)
    whole = 1000 * 64 * 4 + 1000 * 4
    peaks = {}
    for tiles in (1, 4, 10):
        layer = TiledLinear(_layer(), tiles)
        _run(layer, x)
        peaks[tiles] = layer.fetch_tracker.peak
        assert layer.fetch_tracker.current == 0              # every fetched tile was freed
    assert peaks[1] == whole
    for tiles in (4, 10):
        # at most two tiles at once (a tile recomputed in backward while the previous is still held)
        assert peaks[tiles] <= 2 * whole / tiles, (tiles, peaks[tiles])


def test_bounds_and_bad_input():
    assert tile_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="tiles"):
        tile_bounds(4, 5)

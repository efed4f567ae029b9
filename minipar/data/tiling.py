"""Memory-centric tiling (MCT, from ZeRO-Infinity: Rajbhandari et al. 2021, arXiv:2104.07857, §5.1.3):
compute one linear layer that is too large for the device in tiles, one after another, so that only one
tile's parameters are on the device at a time.

    y = x Wᵀ + b,   W split by output rows into W_1 … W_k:   y = [x W_1ᵀ + b_1, …, x W_kᵀ + b_k]

Each tile is fetched (from host memory, from NVMe, or all-gathered from ZeRO-3 shards: here a copy from
the layer's ``store`` of parameters), used and dropped. Autograd would keep every fetched tile alive until
the backward pass, so each tile runs under activation checkpointing: its backward fetches the tile again.
Peak live parameter bytes fall from |W| to about |W|/k (two tiles may overlap for a moment in backward);
activation memory does not change (x and y are whole). The outputs equal the untiled layer's: each output
element is the same dot product.

Seed 003 §8.1 also lists "split the input x" as step 1: that cuts activation memory, not parameters; the
saving of MCT comes from splitting the weight.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..memory import LiveTensorTracker

__all__ = ["TiledLinear", "tile_bounds"]


def tile_bounds(out_features: int, tiles: int) -> list:
    """[(start, stop)] row ranges of ``tiles`` nearly equal tiles (the first ones one row longer)."""
    if not 1 <= tiles <= out_features:
        raise ValueError(f"tiles must be between 1 and out_features={out_features}, got {tiles}")
    base, extra = divmod(out_features, tiles)
    bounds, start = [], 0
    for i in range(tiles):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class TiledLinear(nn.Module):
    """A Linear(in, out) whose weight lives in a store and is brought to the compute device tile by tile.

    ``fetch_tracker`` (a :class:`minipar.memory.LiveTensorTracker`) sees only the fetched tiles: its
    ``current`` is the parameter bytes on the device now, its ``peak`` the most there ever were.
    """

    def __init__(self, linear: nn.Linear, tiles: int, compute_device=None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias          # the store (host / shards)
        self.bounds = tile_bounds(linear.out_features, tiles)
        self.compute_device = compute_device or linear.weight.device
        self.fetch_tracker = LiveTensorTracker()

    def fetch(self, start: int, stop: int):
        """Copy one tile's parameters to the compute device (a new tensor, as a real transfer is)."""
        with self.fetch_tracker:
            w = self.weight[start:stop].to(self.compute_device, copy=True)
            b = None if self.bias is None else self.bias[start:stop].to(self.compute_device, copy=True)
        return w, b

    def _tile(self, x, start: int, stop: int):
        w, b = self.fetch(start, stop)
        return F.linear(x, w, b)

    def forward(self, x):
        outs = [checkpoint(self._tile, x, start, stop, use_reentrant=False) for start, stop in self.bounds]
        return torch.cat(outs, dim=-1)

"""Chapter 03's two ways past the device's memory, each run and checked in one call:

* :func:`offload` — ZeRO-2 on 2 ranks with and without the optimizer on the host (ZeRO-Offload, Ren et al.
  2021: FP32 master shard and Adam's state, 12Ψ/N bytes, on the host; b·Ψ/N bytes each way per step), then the
  same split at 13 B parameters from the calculator (formula, not measured);
* :func:`tiling` — memory-centric tiling (ZeRO-Infinity, Rajbhandari et al. 2021) of one Linear into 1, 4 and
  16 tiles: the same output, the peak of live parameter bytes divided by about the number of tiles.
"""
from __future__ import annotations

import torch

from minipar import launch
from minipar.course.report import Report
from minipar.data import tiling as tiling_module
from minipar.data import zero, zero_measure, zero_memory
from minipar.data.offload import offloaded
from minipar.data.zero_memory import GB, model_state_bytes_formula

from . import claims, figures

__all__ = ["train_stage2", "offload", "tiling"]


def train_stage2(rank, world_size, recipe, offload: bool) -> dict:
    """ZeRO-2 in a plain loop; the device's model-state bytes, and with offload the host's and what went there."""
    model = recipe.model()
    sharded = zero.ZeRO(model, offloaded(recipe.optimizer) if offload else recipe.optimizer, stage=2)
    for x, y in recipe.batches:
        per = len(x) // world_size
        sharded.zero_grad()
        recipe.loss(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        sharded.step()
    out = {"device": zero_measure.measured_zero_state_bytes(sharded), "psi": sharded.padded_numel,
           "params": sharded.full_parameters()}
    if offload:
        out.update(host=sharded.optimizer.host_bytes(), to_host=sharded.optimizer.bytes_to_host,
                   to_device=sharded.optimizer.bytes_to_device)
    return out


def _both(rank, world_size, recipe):
    return train_stage2(rank, world_size, recipe, False), train_stage2(rank, world_size, recipe, True)


def offload(world_size: int = 2, psi_big: float = 13e9, n_big: int = 8) -> Report:
    recipe = figures.memory_recipe()
    plain, off = launch(_both, world_size, recipe, quiet=True)[0]
    p, n = off["psi"], world_size
    gap = max((off["params"][k] - plain["params"][k]).abs().max().item() for k in plain["params"])
    dev, ram = plain["device"], off["device"]
    lines = [f"FP32 run (4 bytes per parameter and gradient), ZeRO-2, Ψ = {p:,} (padded), N = {n}; bytes per rank:",
             f"  device without offload: parameters {dev['params']:,} (4Ψ), gradient shard {dev['grads']:,} (4Ψ/N), "
             f"Adam's moments {dev['optimizer']:,} (8Ψ/N)",
             f"  device with offload:    parameters {ram['params']:,} (4Ψ), gradient shard {ram['grads']:,} (4Ψ/N), "
             f"optimizer {ram['optimizer']:,}",
             f"  host: {off['host']:,} = FP32 master copy + two moments = 12Ψ/N = {12 * p // n:,}; "
             f"per step, gradient shard to host {off['to_host'] // recipe.steps:,} = 4Ψ/N, updated parameter shard "
             f"back {off['to_device'] // recipe.steps:,} = 4Ψ/N (each 2Ψ/N in 16-bit mixed precision)",
             f"offload equals no offload: max |Δ parameter| = {gap}",
             f"\nAt Ψ = {psi_big / 1e9:g} B, N = {n_big}, mixed-precision Adam (formula, not measured):"]
    for stage in (1, 2, 3):
        b = model_state_bytes_formula(psi_big, n_big, stage, "mixed")
        lines.append(f"{zero_memory.STAGE_NAMES[stage]}: {b['total'] / GB:6.1f} GB per device, at most "
                     f"{(b['params'] + b['grads']) / GB:6.1f} GB with the optimizer offloaded "
                     f"({b['optimizer'] / GB:.1f} GB moves to host RAM)")
    return Report("\n".join(lines), lambda r: claims.check_same_training_bit_for_bit(off, plain, p, recipe),
                  plain=plain, off=off)


def tiling(tile_counts=(1, 4, 16)) -> Report:
    """Tile one Linear 1, 4 and 16 ways; each run's output and its gradients (input, weight, bias) against
    the first count's (one tile: untiled), and the peak of live parameter bytes."""
    torch.manual_seed(0)
    big = torch.nn.Linear(256, 4096)
    x = torch.randn(4, 256, requires_grad=True)
    peaks, outputs, grad_gaps, lines = {}, {}, {}, []
    grads = {}
    for tiles in tile_counts:
        big.zero_grad(set_to_none=True)
        x.grad = None
        layer = tiling_module.TiledLinear(big, tiles)
        y = layer(x)
        y.square().mean().backward()
        peaks[tiles], outputs[tiles] = layer.fetch_tracker.peak, y.detach()
        grads[tiles] = [x.grad.clone(), big.weight.grad.clone(), big.bias.grad.clone()]
        grad_gaps[tiles] = max((a - b).abs().max().item() for a, b in zip(grads[tiles], grads[tile_counts[0]]))
        lines.append(f"{tiles:3} tiles: peak live parameter bytes {peaks[tiles] / 1024:8.1f} KiB; vs untiled: "
                     f"output equal {torch.equal(outputs[tiles], outputs[tile_counts[0]])}, gradients (input, "
                     f"weight, bias) max |Δ| {grad_gaps[tiles]:.0e}")
    return Report("\n".join(lines), lambda r: claims.check_memory_centric_tiling_one_layer(outputs, peaks, grad_gaps),
                  peaks=peaks, grad_gaps=grad_gaps, outputs=outputs)

"""One tensor-parallel transformer layer measured on the wire, with chapter 05's variants: shared by the
tour rows of chapters 05 and 06 and by chapter 06's checks.

:func:`minipar.tensor.measure.measure_layer` runs one layer's forward and backward on every rank and counts
its bytes in the communication log and on the sockets; :func:`measure_layer_on_wire` adds the two variants
the chapters compare: the column-parallel inputs kept for backward instead of gathered again
(:func:`minipar.tensor.layers.keep_gathered_inputs`), and the reduce-scatters on minipar's send/recv ring
(:func:`ring_reduce_scatters`: gloo's reduce-scatter all-reduces, 2x the textbook bytes).
"""
from __future__ import annotations

from minipar import comm
from minipar.tensor.layers import keep_gathered_inputs
from minipar.tensor.measure import measure_layer

__all__ = ["ring_reduce_scatters", "measure_layer_on_wire"]


def ring_reduce_scatters(on: bool = True):
    """The reduce-scatters in the block on minipar's send/recv ring (:func:`minipar.comm.ring_algorithms`),
    or, ``on=False``, gloo's as they are."""
    return comm.ring_algorithms("reduce_scatter", enabled=on)


def measure_layer_on_wire(rank, world_size, cfg, sequence_parallel, keep_gathered=False, b=4, s=16, seed=0,
                          rings=False):
    """:func:`minipar.tensor.measure.measure_layer` with chapter 05's variants (keep the gathered input; the
    reduce-scatters on minipar's rings): (bytes in the log's model, bytes written to the sockets, logged
    calls, activation bytes kept)."""
    with ring_reduce_scatters(rings):
        r = measure_layer(rank, world_size, cfg, b, s, sequence_parallel, seed=seed,
                          prepare=lambda block: keep_gathered_inputs(block, keep_gathered))
    return r["bytes_sent"], r["bytes_observed"], r["calls"], r["activation_bytes"]

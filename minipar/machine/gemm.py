"""A matmul's efficiency from its shape, from first principles: output tiles spread over the streaming
multiprocessors (a model, never a measurement).

A GEMM C[M, N] = A[M, K] · B[K, N] (``batch`` of them for a batched matmul) is cut into output tiles of
tm × tn; each SM computes one tile at a time, looping over K in steps of tk (CUTLASS's and cuBLAS's
structure: NVIDIA CUTLASS docs, "Efficient GEMM in CUDA"). Two schedules of the tiles over the SMs:

* ``"waves"`` — data-parallel tiles (cuBLAS on Ampere): ceil(M/tm)·ceil(N/tn)·batch tiles run in waves of
  #SMs; the last wave's idle SMs and the tiles' padding are lost::

      efficiency = M·N·batch / (waves · SMs · tm · tn),   waves = ceil(tiles / SMs)

  When there are fewer tiles than SMs, K is split (split-K) into as many pieces as fill the SMs, each at
  least :data:`MIN_SPLIT_K` long (their partial sums are summed after: a small memory-bound pass, left out).
* ``"stream-k"`` — the K-loop iterations of every tile dealt out evenly over the SMs (Osama et al. 2023,
  "Stream-K"; what Hopper's persistent cuBLAS/CUTLASS kernels do): only the padding of tiles and K-steps and
  the last SM's rounding are lost::

      efficiency = M·N·K·batch / (SMs · ceil(tiles · ceil(K/tk) / SMs) · tm · tn · tk)

The library picks the best of a few tile shapes (:data:`TILES`); so does this model. The card's
``gemm_efficiency`` is then what a full tile sustains (the tensor cores' rate inside a wave), and a skinny
GEMM — few FLOPs per byte — is bound by its bytes through the roofline of :func:`minipar.machine.device.op_seconds`,
not here.
"""
from __future__ import annotations

import math

__all__ = ["TILES", "TK", "MIN_SPLIT_K", "SCHEDULERS", "shape_efficiency"]

TILES = ((128, 256), (256, 128), (128, 128))      # tm × tn of the large-GEMM kernels CUTLASS lists for sm80/sm90
TK = 64                                            # K per main-loop step (16-bit operands)
MIN_SPLIT_K = 512                                  # shortest K a split-K piece keeps (a round number)
SCHEDULERS = ("waves", "stream-k")


def _waves(batch, m, k, n, sms, tm, tn) -> float:
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    best = 0.0
    for split in range(1, max(1, min(sms // tiles, k // MIN_SPLIT_K)) + 1):
        waves = math.ceil(tiles * split / sms)
        best = max(best, batch * m * n * split / (waves * sms * tm * tn))
    return best


def _stream_k(batch, m, k, n, sms, tm, tn) -> float:
    steps = batch * math.ceil(m / tm) * math.ceil(n / tn) * math.ceil(k / TK)
    return batch * m * n * k / (sms * math.ceil(steps / sms) * tm * tn * TK)


def shape_efficiency(shape, sms: int, scheduler: str = "waves") -> float:
    """The fraction of a full-tile rate a GEMM of ``shape`` = (batch, M, K, N) reaches on ``sms`` SMs under
    ``scheduler`` ("waves" or "stream-k"): the best over :data:`TILES` of the formulas above."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
    batch, m, k, n = shape
    if min(batch, m, k, n) < 1 or sms < 1:
        raise ValueError(f"a GEMM shape (batch, M, K, N) of positive sizes and sms >= 1, got {shape}, {sms}")
    one = _waves if scheduler == "waves" else _stream_k
    return max(one(batch, m, k, n, sms, tm, tn) for tm, tn in TILES)

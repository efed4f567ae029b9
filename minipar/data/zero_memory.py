"""How many bytes of model state each rank holds, and sends, under DDP and ZeRO-1/2/3: the formulas of the
ZeRO paper (Rajbhandari et al. 2020, §3 and §5.1, Figure 1; §7 for the communication volume).

With Ψ parameters on N data-parallel ranks, b_p and b_g bytes per parameter and per gradient element and
K bytes of optimizer state per parameter::

    DDP     (stage 0)   (b_p + b_g + K) Ψ                 mixed-precision Adam: (2 + 2 + 12) Ψ = 16 Ψ
    ZeRO-1  (P_os)      b_p Ψ + b_g Ψ + K Ψ / N           2Ψ + 2Ψ + 12Ψ/N
    ZeRO-2  (P_os+g)    b_p Ψ + (b_g + K) Ψ / N           2Ψ + 14Ψ/N
    ZeRO-3  (P_os+g+p)  (b_p + b_g + K) Ψ / N             16Ψ/N

Mixed-precision Adam keeps FP16/BF16 parameters and gradients (2 + 2 bytes) and, in K = 12, an FP32 master
copy, momentum and variance (4 + 4 + 4). Plain FP32 Adam has b_p = b_g = 4 and K = 8 (no separate master).
The paper's example: Ψ = 7.5 B, N = 64, K = 12 gives 120 GB, 31.4 GB, 16.6 GB and 1.9 GB (decimal GB).

Bytes sent per rank per step (ring collectives, minipar.comm's model): DDP's all-reduce is a
reduce-scatter plus an all-gather, 2 · b · Ψ · (N-1)/N. ZeRO-1/2 replace it by a reduce-scatter of the
gradients and an all-gather of the updated parameters: the same 2 b Ψ (N-1)/N. ZeRO-3 all-gathers each
unit's parameters twice (forward, backward) and reduce-scatters its gradients: 3 b Ψ (N-1)/N, 1.5x.

Units: GB = 10⁹ bytes (what the paper and vendors print), GiB = 2³⁰ bytes (what memory tools print).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..validation import positive_int

__all__ = ["Precision", "PRECISIONS", "GB", "GiB", "STAGE_NAMES", "model_state_bytes_formula", "bytes_sent_per_step",
           "padded_numel", "fmt", "table"]

GB = 10 ** 9
GiB = 2 ** 30
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter: compute parameters, gradients, optimizer state (K)."""
    param: int
    grad: int
    optimizer: int


PRECISIONS = {"fp32": Precision(4, 4, 8), "mixed": Precision(2, 2, 12)}


def _precision(precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)} or a Precision, got {precision!r}")
    return PRECISIONS[precision]


def _check(psi, n, stage) -> None:
    if psi < 0:
        raise ValueError(f"the parameter count must be non-negative, got {psi!r}")
    positive_int("N (data-parallel ranks)", n)
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be one of {list(STAGE_NAMES)} (0 = DDP), got {stage!r}")


def model_state_bytes_formula(psi: float, n: int, stage: int, precision="mixed") -> dict:
    """{"params", "grads", "optimizer", "total"} bytes per rank for Ψ = ``psi`` parameters."""
    _check(psi, n, stage)
    p = _precision(precision)
    params = p.param * psi / (n if stage >= 3 else 1)
    grads = p.grad * psi / (n if stage >= 2 else 1)
    optimizer = p.optimizer * psi / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def bytes_sent_per_step(psi: float, n: int, stage: int, precision="mixed") -> float:
    """Bytes one rank sends in one training step (no gradient accumulation)."""
    _check(psi, n, stage)
    p = _precision(precision)
    ring = (n - 1) / n
    if stage == 3:
        return ring * psi * (2 * p.param + p.grad)       # all-gather fwd + all-gather bwd + reduce-scatter
    return ring * psi * (p.grad + p.grad if stage == 0 else p.grad + p.param)


def padded_numel(unit_numels, n: int) -> int:
    """Ψ after padding every flat unit to a multiple of N (what a sharded implementation really holds)."""
    return sum(-(-k // n) * n for k in unit_numels)


def fmt(nbytes: float, unit: str = "GB") -> str:
    """``fmt(1.2e11) == '120.0 GB'``; ``unit`` is 'GB' (10⁹), 'GiB' (2³⁰), 'MB', 'MiB', 'KiB' or 'B'."""
    div = {"GB": GB, "GiB": GiB, "MB": 10 ** 6, "MiB": 2 ** 20, "KiB": 2 ** 10, "B": 1}[unit]
    return f"{nbytes / div:.1f} {unit}" if unit != "B" else f"{nbytes:.0f} B"


def table(psi: float, n: int, precision="mixed", unit: str = "GB") -> str:
    """A text table of every stage for Ψ and N, the way the chapter prints it."""
    rows = [f"{'':8}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}{'sent/step':>12}"]
    for stage, name in STAGE_NAMES.items():
        b = model_state_bytes_formula(psi, n, stage, precision)
        cells = [fmt(b[k], unit) for k in ("params", "grads", "optimizer", "total")]
        cells.append(fmt(bytes_sent_per_step(psi, n, stage, precision), unit))
        rows.append(f"{name:8}" + "".join(f"{c:>12}" for c in cells))
    return "\n".join(rows)

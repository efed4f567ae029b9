"""A declared GPU, from first principles: what one operator costs on it (a model, never a measurement).

A roofline with a floor (Williams et al. 2009, "Roofline"; How to Scale Your Model, ch. 1; the Ultra-Scale
Playbook's GPU primer). An operator that does F FLOPs and moves B bytes between HBM and the chip in k kernels
lasts::

    t = max(F / (peak · η_F),  B / (HBM bandwidth · η_B))  +  k · launch floor

* η_F — the fraction of the tensor cores' peak a kernel of that kind reaches: ``gemm_efficiency`` for a large
  matmul (at most one number fitted per card, to one named published run: :data:`FITTED`), ``attention_efficiency`` for a fused
  FlashAttention kernel (Dao 2023: 50–73 % of an A100's peak forward + backward; FlashAttention-3, Shah et
  al. 2024: FlashAttention-2 reaches about 35 % of an H100's). An element-wise operator's FLOPs are so few
  that its bytes decide.
* η_B — the share of the HBM's datasheet bandwidth a streaming kernel reaches (``memory_efficiency``).
* the floor — what one kernel costs the device however small it is (its launch and start-up).

An eager PyTorch program adds a second clock: the host (Python, the dispatcher, autograd) spends about
:data:`EAGER_HOST_SECONDS` on each operator before the device can run it. Measured on one H100
(:mod:`minipar.machine.gpu_measured`), a tiny model's training step lasts its operators × that host time — about
eight times its kernels' own time — so :func:`eager_bounds` gives the two limits such a step lies between:
max(device, host) when the host runs ahead of the device, device + host when it never does.

So the efficiency of a matmul against its size is not a table: it is F / (peak · t) of this formula — small
matmuls are bound by their bytes or by the floor, large ones by η_F. :class:`Op` is one operator (or k alike
ones), counted from a program by :mod:`minipar.observe.opcount` or written down by
:mod:`minipar.plan.operators` for a model of real size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .gemm import shape_efficiency

__all__ = ["DeviceCard", "Op", "op_seconds", "ops_seconds", "flops_efficiency", "kernel_count", "ops_of", "rows_of", "A100_SXM_80GB",
           "A100_SXM_40GB", "H100_SXM", "H100_SXM_500W", "B200", "TITAN_RTX", "CARDS", "FITTED", "achieved_flops", "EAGER_HOST_SECONDS", "eager_bounds"]


@dataclass(frozen=True)
class DeviceCard:
    """One GPU: ``peak_flops`` (16-bit tensor cores, dense), ``hbm_bandwidth`` (bytes/s), ``memory_bytes``,
    ``launch_floor`` (seconds per kernel), the efficiencies η of the module's formula, and where each number
    comes from (``source``)."""
    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: float
    launch_floor: float
    gemm_efficiency: float
    attention_efficiency: float
    memory_efficiency: float
    source: str = ""
    sms: int = 0                  # streaming multiprocessors: a GEMM with a shape is priced by its tiles (0: not)
    gemm_scheduler: str = "waves"   # how its GEMM library deals tiles to the SMs (minipar.machine.gemm)


@dataclass(frozen=True)
class Op:
    """``count`` alike operators: each does ``flops`` FLOPs, moves ``bytes`` bytes and launches ``kernels``
    kernels. ``kind``: "gemm" (a matmul), "attention" (a fused attention kernel) or "memory" (everything
    else: element-wise, norms, softmax, reductions, copies, the optimizer). ``shape``: a GEMM's
    (batch, M, K, N), when known: its efficiency is then the card's × :func:`minipar.machine.gemm.shape_efficiency`."""
    name: str
    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    kernels: int = 1
    count: float = 1
    shape: tuple = ()

    def __post_init__(self):
        if self.kind not in ("gemm", "attention", "memory"):
            raise ValueError(f"Op.kind must be 'gemm', 'attention' or 'memory', got {self.kind!r}")


def flops_efficiency(op: Op, card: DeviceCard) -> float:
    """η_F of ``op`` on ``card``: the card's for its kind; a GEMM with a shape on a card that gives its SMs
    also pays its tiles' quantization (:func:`minipar.machine.gemm.shape_efficiency`)."""
    eta = {"gemm": card.gemm_efficiency, "attention": card.attention_efficiency, "memory": 1.0}[op.kind]
    if op.kind == "gemm" and op.shape and card.sms:
        eta *= shape_efficiency(op.shape, card.sms, card.gemm_scheduler)
    return eta


def op_seconds(op: Op, card: DeviceCard) -> float:
    """Seconds of ``op.count`` operators on ``card``: count · (max(F / (peak·η_F), B / (HBM·η_B)) + k·floor),
    η_F from :func:`flops_efficiency`."""
    eta = flops_efficiency(op, card)
    compute = op.flops / (card.peak_flops * eta) if op.flops else 0.0
    memory = op.bytes / (card.hbm_bandwidth * card.memory_efficiency)
    return op.count * (max(compute, memory) + op.kernels * card.launch_floor)


def ops_seconds(ops, card: DeviceCard) -> float:
    """Seconds of a list of :class:`Op` run one after another on ``card``."""
    return sum(op_seconds(op, card) for op in ops)


# Host seconds per eager operator, measured: the median of a launch-bound run's wall time ÷ its counted
# operators over the launch-bound runs of tools/gpu_operators.py on one H100 (minipar/machine/data/gpu/; the
# spread, 37–100 µs over ten, and the runs: minipar.machine.gpu_measured.host_seconds_per_operator).
EAGER_HOST_SECONDS = 39e-6


def eager_bounds(ops, card: DeviceCard, host: float = EAGER_HOST_SECONDS) -> tuple:
    """(low, high) seconds of ``ops`` run by eager PyTorch: the device needs D = :func:`ops_seconds`, the host
    n · ``host`` for the n kernels it enqueues. The host never waits for the device, so the step lasts at
    least max(D, n · host) (perfect overlap) and at most D + n · host (none: each kernel waits for its launch)."""
    device = ops_seconds(ops, card)
    host_total = host * sum(op.count * op.kernels for op in ops)
    return max(device, host_total), device + host_total


def achieved_flops(op: Op, card: DeviceCard) -> float:
    """FLOP/s the model gives ``op`` on ``card`` (its efficiency against size is this over the peak)."""
    return op.flops * op.count / op_seconds(op, card)


# What was fitted (python -m minipar bench published --fit prints the fit again): at most one number per card,
# each fitted to ONE published run named here, its calibration row (minipar.plan.published); every other row
# of bench published is a check. Everything else is a datasheet, a paper or a measurement.
FITTED = {"A100-SXM4-80GB": ("calibration: gemm_efficiency = 0.83 (a full tile's; each GEMM × its shape's tile "
                             "efficiency), fitted to Korthikanti et al. 2022 Table 5's "
                             "175B SP + selective row alone (GPT-3, chosen before the fit); the other seven "
                             "rows of that table and MT-NLG's three (the same card, on the same Selene) are "
                             "checks"),
          "H100-SXM5-80GB": ("no calibration: gemm_efficiency = 0.73, measured: a full tile's rate, the median "
                             "over the FLOP-bound ones of 78 timings of matmuls from "
                             "three GPT layer sizes, each run ten times back to back, on one H100 80GB HBM3 "
                             "(700 W, torch 2.11, 2026-11-27; tools/gpu_operators.py, minipar/machine/data/gpu/, "
                             "minipar.machine.gpu_measured.full_tile_efficiency); range 0.43–0.82"),
          "H100-SXM-500W": ("calibration: gemm_efficiency = 0.45, fitted to torchtitan's Llama-3.1-8B FSDP row "
                            "alone; not a kernel's efficiency (one H100 at 700 W measured 0.73): it carries the "
                            "500 W clock and whatever of torchtitan's eager step the operator model misses. Its "
                            "Llama-3.1-405B FSDP + TP row is the check")}

_FLOOR = ("launch floor 5 µs: what one kernel costs the device however small it is, a round number; one H100 "
          "ran the 53 kernels of a tiny layer's forward + backward in 111 µs of kernel time (2 µs each), and "
          "enqueued one-element adds at one per 8–11 µs. Eager PyTorch adds the host's own time: about "
          f"{EAGER_HOST_SECONDS * 1e6:.0f} µs per operator (Python, dispatcher, autograd) before the device can "
          "run it, the median over ten launch-bound runs on one H100")

A100_SXM_80GB = DeviceCard(
    "A100-SXM4-80GB", 312e12, 2.039e12, 80e9, 5e-6, gemm_efficiency=0.83, attention_efficiency=0.72,
    memory_efficiency=0.85, sms=108, gemm_scheduler="waves",
    source="NVIDIA A100 datasheet: 312 TFLOP/s BF16/FP16 dense, 2,039 GB/s HBM2e (80 GB SXM), 108 SMs; GEMM "
           "tiles dealt in waves (cuBLAS on Ampere, the kernels of Megatron's 2022 runs); attention: "
           "FlashAttention-2 (Dao 2023) reaches 50–73 % of peak forward + backward, the card takes about its best, "
           "0.72; HBM: 85 %, about what streaming benchmarks reach (a round number); " + _FLOOR)

A100_SXM_40GB = dataclasses.replace(
    A100_SXM_80GB, name="A100-SXM4-40GB", hbm_bandwidth=1.555e12, memory_bytes=40e9,
    source="NVIDIA A100 datasheet: 40 GB HBM2 at 1,555 GB/s (SXM); the same chip as A100-SXM4-80GB, whose "
           "efficiencies (and calibration) it shares: nothing is fitted to it")

H100_SXM = DeviceCard(
    "H100-SXM5-80GB", 989e12, 3.35e12, 80e9, 5e-6, gemm_efficiency=0.73, attention_efficiency=0.35,
    memory_efficiency=0.85, sms=132, gemm_scheduler="stream-k",
    source="NVIDIA H100 datasheet: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3 (SXM5, 700 W), 132 SMs; GEMM tiles "
           "stream-K scheduled (Hopper's persistent cuBLAS kernels); attention: "
           "FlashAttention-2 reaches about 35 % of an H100 (Shah et al. 2024, FlashAttention-3); GEMM "
           "efficiency: measured on one H100 (FITTED); " + _FLOOR)

H100_SXM_500W = DeviceCard(
    "H100-SXM-500W", 989e12, 2.4e12, 96e9, 5e-6, gemm_efficiency=0.45, attention_efficiency=0.35,
    memory_efficiency=0.85, sms=132, gemm_scheduler="stream-k",
    source="torchtitan docs/performance.md: Grand Teton hosts, H100 with 96 GB HBM2e at 2.4 TB/s, power "
           "limited to 500 W (below the 700 W the 989 TFLOP/s peak assumes: the fitted GEMM efficiency "
           "carries the lower clock); attention and floor as H100-SXM5-80GB")

B200 = DeviceCard(
    "B200 (GB200 NVL72)", 2.5e15, 8e12, 186e9, 5e-6, gemm_efficiency=0.73, attention_efficiency=0.35,
    memory_efficiency=0.85, sms=148, gemm_scheduler="stream-k",
    source="NVIDIA GB200 NVL72 datasheet: 360 PFLOP/s BF16 per 72 GPUs with sparsity (2.5 PFLOP/s dense each), "
           "HBM3e 8 TB/s, 186 GB; 148 SMs; the efficiencies are the H100's, ASSUMED (nothing measured on a "
           "B200, nothing fitted)")

TITAN_RTX = DeviceCard(
    "TITAN RTX", 130e12, 672e9, 24e9, 5e-6, gemm_efficiency=0.6, attention_efficiency=0.35,
    memory_efficiency=0.85, sms=72, gemm_scheduler="waves",
    source="NVIDIA Turing architecture whitepaper: TITAN RTX, 130 TFLOP/s FP16 tensor cores, 24 GB GDDR6 at "
           "672 GB/s, 72 SMs; seed 002's machine (PCIe 3.0, no NVLink: gpu_cluster(TITAN_RTX, 1, PCIE3, PCIE3, "
           "devices_per_node=n)). The efficiencies are ASSUMED, nothing measured on a TITAN RTX, nothing fitted: "
           "GEMM 0.6 (a round number), attention the H100's, memory the A100's; " + _FLOOR)

CARDS = {card.name: card for card in (A100_SXM_80GB, A100_SXM_40GB, H100_SXM, H100_SXM_500W, B200, TITAN_RTX)}


# Operator rows (what minipar.observe.opcount.OperatorCounter.take returns, and what a trace's Compute holds)

def kernel_count(rows) -> int:
    """Kernels in ``rows`` (a :meth:`OperatorCounter.take` list: one per operator; a row written from a
    model's operators may say ``"kernels"`` per operator)."""
    return sum(r["count"] * r.get("kernels", 1) for r in rows)


def ops_of(rows) -> list:
    """``rows`` as :class:`minipar.machine.device.Op` objects, to price on a card."""
    return [Op(r["name"], r["kind"], r["flops"], r["bytes"], r.get("kernels", 1), r["count"], tuple(r.get("shape", ())))
            for r in rows]


def rows_of(ops) -> list:
    """:class:`minipar.machine.device.Op` objects as rows (the inverse of :func:`ops_of`)."""
    return [{"name": o.name, "kind": o.kind, "count": o.count, "flops": o.flops, "bytes": o.bytes,
             "kernels": o.kernels, **({"shape": o.shape} if o.shape else {})} for o in ops]

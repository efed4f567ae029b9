"""Published training runs, and what the planner predicts for them with one set of constants: the check of the
model of time against real clusters (``python -m minipar bench published``).

Every prediction is :func:`minipar.plan.estimate` on a cluster built from device and link cards
(:func:`minipar.machine.cluster.gpu_cluster`): compute from the operators of :mod:`.operators`, collectives from
the α-β model, the pipeline bubble from the schedule. At most one number per card is fitted, each to one
named run, its **calibration** row (:data:`minipar.machine.device.FITTED` says which; :func:`fit_gemm_efficiency`
redoes the fit); every other row is a **check**: a run no constant was chosen for. :func:`summary` counts the
check rows within the tolerance apart from the calibration rows (which lie on their fit by construction).

Sources:

* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 3 (models:
  s = 2048, V = 51200, t = 8, micro-batch 1, the pipeline sizes below) and Table 5 (iteration seconds on DGX
  A100 nodes; "present work" = sequence parallelism + selective recomputation, against full recomputation).
  Source check: the present-work rows' MFU (41.5, 51.4, 56.0, 56.3 %) are confirmed by the Megatron-LM README,
  which the times reproduce through the FLOP formula (tests/test_plan_model.py); the full-recomputation times
  were typed from the paper's table, not found as text here.
* torchtitan, docs/performance.md, Table 1: Llama-3.1-8B on 8 H100 (Grand Teton, 500 W), FSDP, local batch 2,
  sequence 8192, selective (op-level) activation checkpointing, no torch.compile: 5,762 tokens/s per GPU; and
  its Llama-3.1-405B table: 128 H100, FSDP 16 × TP 8 (with sequence parallelism), local batch 2, full
  checkpointing, no Float8: 109 tokens/s per GPU (torchtitan divides a data-parallel rank's tokens by the 8
  GPUs of its tp group: 2·8192/8 tokens per GPU per step) at 29.0 % MFU, which the step time reproduces. That
  table says "H100 (94GB memory)" and no power limit; the check assumes Table 1's machine (Grand Teton's 96 GB
  H100, which reports about 94 GiB, at 500 W) — an assumption, said here.
* Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", §2.4: the 530B model
  (105 layers, h = 20480, 128 heads, s = 2048) on 280, 350 and 420 DGX A100 nodes of Selene (§2.4: "8 NVIDIA
  80-GB A100 GPUs" a node, eight 200 Gb/s HDR InfiniBand HCAs), TP 8 ×
  PP 35 × DP 8, 10, 12, global batch 1920: 60.1, 50.2 and 44.4 s per iteration (126, 121, 113 TFLOP/s per
  GPU, which the times reproduce through the full-recomputation FLOP formula). Source check: typed from the
  llm-analysis project's README (cli99/llm-analysis, examples/megatron-turing-nlg), which quotes the paper;
  the vocabulary padded to 51,200 as Megatron pads it for t = 8, micro-batch 1, full recomputation and ZeRO-1
  (DeepSpeed's pipeline engine) are assumptions, said here.
* Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3 and Table 4 (Llama 3 405B pretraining, H100 at 700 W,
  80 GB HBM3, 8 per server on NVLink, 400 Gb/s RoCE per GPU): TP 8, CP 1/1/16, PP 16, DP 64/128/8 on 8,192 /
  16,384 / 16,384 GPUs, sequence 8,192 / 8,192 / 131,072, 16M tokens per batch (batch 32 / 16 / 16 sequences
  per DP rank), 430 / 400 / 380 TFLOP/s per GPU, BF16 MFU 43 / 41 / 38 %. Source check: the GPUs, TP, CP, PP,
  tokens per batch and TFLOP/s match the slide of Meta's SC'24 talk as quoted on glennklockwood.com/garden/
  llama-3.1; the table's own text was not found here: DP, the sequence lengths and the MFU were typed from
  memory (DP = GPUs / (TP·CP·PP) and MFU = TFLOP/s / 989 agree with them). Published seconds per iteration:
  model FLOPs (:func:`.model.model_flops`, the s² attention counted whole as in the other rows) / (GPUs ·
  TFLOP/s) — an assumption: had Meta counted causal attention (half the s² term), the 8K rows' seconds
  would be 4 % shorter and the 128K row's 29 % shorter. Assumptions, said here: the H100-SXM5-80GB card
  (its measured, unfitted 0.73); RoCE priced as the NDR card (400 Gb/s a GPU); fused kernels
  (:data:`.operators.LLAMA3_2024`: FlashAttention, fused RMSNorm, SwiGLU, RoPE, no dropout); sequence
  parallelism in the TP group; no activation recomputation (none is named); Meta's FSDP, which does not
  reshard after the forward, priced as ZeRO-1 (one reduce-scatter of the gradients and one all-gather of
  the parameters per step); overlap as the production libraries run it (``overlap=True``: DP under the
  backward); the interleaved schedule with v = 8 (126 layers + the embedding + the output = 128 = 16 · 8
  chunks of one layer each: the balanced cut of :func:`.model.stage_layers`); CP's all-gather of K and V
  priced as ring-zigzag attention's passes (the same bytes; causal load balance on 2·CP chunks).
  Open: the planner's memory for these three rows (94, 86 and 98 GB a GPU) exceeds the 80 GB card. Its
  activations are those of Megatron-LM's interleaved 1F1B on the first stage: on 8K GPUs (32 micro-batches)
  p + (p − 1)/v = 17.9 stages' worth in flight (143 one-layer chunks) × about 0.57 GB a layer (SP, fused
  attention, BF16, no recomputation) = 81 GB; on 16K GPUs (16 micro-batches) 16 stages' worth, 72 GB. Meta's schedule bounds the micro-batches in flight by a tunable N (§3.3.2, Figure 6)
  and frees each stage's input and output tensors early; the planner models neither, so it prices these
  rows' time but cannot say they fit.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from minipar.data.zero_memory import Precision
from minipar.layout import Layout
from minipar.machine.cluster import IB_HDR, IB_NDR, NVLINK3, NVLINK4, gpu_cluster
from minipar.machine.device import A100_SXM_80GB, H100_SXM, H100_SXM_500W, DeviceCard

from .cost import estimate
from .model import Transformer, model_flops
from .operators import LLAMA3_2024, MEGATRON_2022, TORCHTITAN_EAGER, Kernels

__all__ = ["PublishedRun", "RUNS", "predict", "table", "fit_gemm_efficiency", "summary", "table_text", "TOLERANCE",
           "mt_nlg_against_korthikanti", "spread_by_source", "ranking_error", "rounded_up"]

KORTHIKANTI = "Korthikanti et al. 2022, Table 5"
TORCHTITAN = "torchtitan docs/performance.md, Table 1"
TORCHTITAN_405B = "torchtitan docs/performance.md, Llama 3.1 405B"
MT_NLG = "Smith et al. 2022 (MT-NLG), §2.4"
LLAMA3 = "Dubey et al. 2024 (Llama 3), Table 4"
TOLERANCE = 0.15


@dataclass(frozen=True)
class PublishedRun:
    """A run as published: its model, layout, GPUs (``card`` × ``nodes`` nodes of 8, ``intra``/``inter`` links),
    framework (``kernels``), the published seconds per iteration and where they come from. ``calibration``:
    the run its card's one fitted number was fitted to (else a check: nothing was chosen for it)."""
    name: str
    model: Transformer
    layout: Layout
    card: DeviceCard
    nodes: int
    links: tuple
    kernels: Kernels
    seconds: float
    source: str
    precision: object = "mixed"
    overlap: object = False
    calibration: bool = False
    note: str = ""


def _korthikanti(name, heads, hidden, layers, pp, batch, seconds, full):
    model = Transformer(layers, hidden, heads, 51200, 2048)
    layout = Layout(tp=8, pp=pp, sp=not full, recompute="full" if full else "selective", micro_batch=1,
                    micro_batches=batch)
    return PublishedRun(f"{name} {'full recompute' if full else 'SP + selective'}", model, layout, A100_SXM_80GB,
                        8 * pp // 8, (NVLINK3, IB_HDR), MEGATRON_2022, seconds, KORTHIKANTI,
                        calibration=(name, full) == ("175B", False))      # GPT-3: chosen before any fit


def _mt_nlg(nodes, seconds):
    dp = nodes * 8 // (8 * 35)
    layout = Layout(tp=8, pp=35, dp=dp, zero=1, recompute="full", micro_batch=1, micro_batches=1920 // dp)
    return PublishedRun(f"MT-NLG 530B, {nodes} nodes", Transformer(105, 20480, 128, 51200, 2048), layout,
                        A100_SXM_80GB, nodes, (NVLINK3, IB_HDR), MEGATRON_2022, seconds, MT_NLG,
                        note="a check that misses: its published pipeline is slower than Korthikanti et al.'s "
                             "same model, layout and chip (mt_nlg_against_korthikanti)")


LLAMA31_8B = Transformer(32, 4096, 32, 128256, 8192, ffn_hidden=14336, tied_embeddings=False, final_norm=True,
                         kv_heads=8, gated_mlp=True)
LLAMA31_405B = Transformer(126, 16384, 128, 128256, 8192, ffn_hidden=53248, tied_embeddings=False, final_norm=True,
                           kv_heads=8, gated_mlp=True)
TORCHTITAN_PRECISION = Precision(2, 4, 12)


def _llama3(gpus, cp, dp, per_dp, seq, tflops):
    """A row of Llama 3's Table 4: its published seconds are the model's FLOPs at the published rate."""
    model = dataclasses.replace(LLAMA31_405B, seq_len=seq)
    layout = Layout(dp=dp, tp=8, pp=16, v=8, cp=cp, sp=True, zero=1, micro_batch=1, micro_batches=per_dp,
                    schedule="interleaved", cp_method="ring-zigzag")
    seconds = model_flops(model, dp * per_dp) / (gpus * tflops * 1e12)
    return PublishedRun(f"Llama 3 405B {gpus // 1024}K GPUs {seq // 1024}K", model, layout, H100_SXM,
                        gpus // 8, (NVLINK4, IB_NDR), LLAMA3_2024, seconds, LLAMA3, overlap=True)      # BF16 parameters, gradients reduced in FP32, FP32 Adam

RUNS = [
    *(_korthikanti(*row, full=False) for row in (("22B", 64, 6144, 48, 1, 4, 1.10), ("175B", 96, 12288, 96, 8, 64, 13.75),
                                                  ("530B", 128, 20480, 105, 35, 280, 37.83),
                                                  ("1T", 160, 25600, 128, 64, 512, 71.49))),
    *(_korthikanti(*row, full=True) for row in (("22B", 64, 6144, 48, 1, 4, 1.42), ("175B", 96, 12288, 96, 8, 64, 18.13),
                                                 ("530B", 128, 20480, 105, 35, 280, 49.05),
                                                 ("1T", 160, 25600, 128, 64, 512, 94.42))),
    PublishedRun("Llama-3.1-8B FSDP", LLAMA31_8B, Layout(dp=8, zero=3, recompute="selective", micro_batch=2),
                 H100_SXM_500W, 1, (NVLINK4, IB_NDR), TORCHTITAN_EAGER, 2 * 8192 / 5762, TORCHTITAN,
                 precision=TORCHTITAN_PRECISION, overlap=True, calibration=True),
    PublishedRun("Llama-3.1-405B FSDP + TP", LLAMA31_405B,
                 Layout(dp=16, tp=8, sp=True, zero=3, recompute="full", micro_batch=2), H100_SXM_500W, 16,
                 (NVLINK4, IB_NDR), TORCHTITAN_EAGER, 2 * 8192 / 8 / 109, TORCHTITAN_405B,
                 precision=TORCHTITAN_PRECISION, overlap=True),
    *(_mt_nlg(nodes, seconds) for nodes, seconds in ((280, 60.1), (350, 50.2), (420, 44.4))),
    *(_llama3(*row) for row in ((8192, 1, 64, 32, 8192, 430), (16384, 1, 128, 16, 8192, 400),
                                (16384, 16, 8, 16, 131072, 380))),
]


def predict(run: PublishedRun, card: DeviceCard | None = None):
    """The planner's :class:`~.cost.Estimate` for ``run`` (on ``card`` instead of the run's, to fit)."""
    cluster = gpu_cluster(card or run.card, run.nodes, *run.links)
    return estimate(run.model, cluster, run.layout, precision=run.precision, overlap=run.overlap,
                    kernels=run.kernels)


def table(runs=RUNS) -> list:
    """[{"run", "device", "published", "predicted", "ratio", "terms", "role", "source"}] — seconds per
    iteration; ``role``: "calibration" (its card's one fitted number was fitted to it) or "check"."""
    rows = []
    for run in runs:
        got = predict(run)
        rows.append({"run": run.name, "device": f"{run.nodes * 8}× {run.card.name}", "published": run.seconds,
                     "predicted": got.step_seconds, "ratio": got.step_seconds / run.seconds,
                     "terms": {k: v for k, v in got.time.items() if k != "total" and v},
                     "role": "calibration" if run.calibration else "check", "source": run.source,
                     **({"note": run.note} if run.note else {})})
    return rows


def mt_nlg_against_korthikanti(runs=RUNS) -> dict:
    """Published against published: MT-NLG's 280-node row and Korthikanti et al.'s 530B full-recomputation
    row are the same model (105 layers, h = 20480, s = 2048), layout (TP 8, PP 35, micro-batch 1, full
    recomputation) and card (A100-SXM4-80GB on Selene, both). Each published time includes its 1F1B bubble,
    so each is normalised to one pipeline slot: seconds / (m + p − 1), m the micro-batches a pipeline runs
    per iteration (MT-NLG 1920 / 8 = 240, Korthikanti 280), p = 35. {"mt_nlg", "korthikanti": seconds per
    slot, "factor": their ratio, "per_sequence": the ratio of seconds per sequence per pipeline (bubble
    left in)}. A factor no model of the hardware closes (the model puts the two within a few % of each
    other: MT-NLG's DP all-reduce): MT-NLG's rows stay checks that miss."""
    by_name = {r.name: r for r in runs}
    mt, ko = by_name["MT-NLG 530B, 280 nodes"], by_name["530B full recompute"]
    slots = {k: r.seconds / (r.layout.micro_batches + r.layout.pp - 1)
             for k, r in (("mt_nlg", mt), ("korthikanti", ko))}
    per_sequence = (mt.seconds / mt.layout.micro_batches) / (ko.seconds / ko.layout.micro_batches)
    return {**slots, "factor": slots["mt_nlg"] / slots["korthikanti"], "per_sequence": per_sequence}


def spread_by_source(rows) -> dict:
    """{source: max ratio / min ratio} over each source's rows (model ÷ published seconds; the source's name up to
    its first comma, so one paper's tables count together). Inside one source the runs share a software stack, so
    a miss common to them all cancels: the spread is the model's error in *ranking* that source's runs, not its
    absolute error (MT-NLG's rows all miss by about 25 %, yet lie within a few % of each other)."""
    ratios = {}
    for r in rows:
        ratios.setdefault(r["source"].split(",")[0], []).append(r["ratio"])
    return {src: max(v) / min(v) for src, v in ratios.items()}


@functools.lru_cache(maxsize=1)
def ranking_error(step: float = 0.05) -> float:
    """The model's error in ranking two layouts on one software stack: the widest :func:`spread_by_source` over
    :data:`RUNS`, less one, rounded up to a multiple of ``step`` (9.8 % → 0.10). The planner treats two layouts
    closer than this as equal (:func:`minipar.plan.plan`)."""
    return rounded_up(max(spread_by_source(table()).values()) - 1, step)


def rounded_up(error: float, step: float = 0.05) -> float:
    """``error`` rounded up to a multiple of ``step`` (0.083 → 0.10): how :func:`ranking_error` turns a spread into
    a band."""
    return step * math.ceil(error / step - 1e-9)


def summary(rows, tolerance: float = TOLERANCE) -> dict:
    """{"calibration": rows fitted to, "check": rows not, "inside": check rows within ±``tolerance``,
    "outside": names of the check rows beyond it}: the count that means something is the checks'."""
    checks = [r for r in rows if r["role"] == "check"]
    outside = [r["run"] for r in checks if abs(r["ratio"] - 1) > tolerance]
    return {"calibration": sum(r["role"] == "calibration" for r in rows), "check": len(checks),
            "inside": len(checks) - len(outside), "outside": outside}


def fit_gemm_efficiency(runs, card: DeviceCard, grid=None) -> tuple:
    """(η, worst |ratio − 1|): the card's large-matmul efficiency that minimises the largest error over
    ``runs`` (a grid search over 0.30–0.95 in steps of 0.005)."""
    best = None
    for eta in grid or [0.30 + 0.005 * i for i in range(131)]:
        trial = dataclasses.replace(card, gemm_efficiency=eta)
        worst = max(abs(predict(run, trial).step_seconds / run.seconds - 1) for run in runs)
        if best is None or worst < best[1]:
            best = (eta, worst)
    return best


def table_text(rows, tolerance: float = TOLERANCE) -> str:
    """The rows, calibration rows first, and a last line counting the check rows within ±``tolerance``."""
    lines = [f"{'run':26}{'GPUs':>22}{'published s':>13}{'model s':>9}{'ratio':>7}{'role':>13}  source"]
    for r in sorted(rows, key=lambda r: r["role"] != "calibration"):
        lines.append(f"{r['run']:26}{r['device']:>22}{r['published']:>13.2f}{r['predicted']:>9.2f}"
                     f"{r['ratio']:>7.2f}{r['role']:>13}  {r['source']}")
    got, pair = summary(rows, tolerance), mt_nlg_against_korthikanti()
    lines.append(f"{got['calibration']} calibration row(s) (fitted to, not a check); {got['inside']} of "
                 f"{got['check']} check rows within ±{tolerance:.0%}"
                 + (f"; outside: {', '.join(got['outside'])}" if got["outside"] else ""))
    lines.append(f"Published against published: MT-NLG 530B on 280 nodes and Korthikanti et al.'s 530B full "
                 f"recompute (same model, TP 8 · PP 35, A100) take {pair['mt_nlg']:.3f} and "
                 f"{pair['korthikanti']:.3f} s per pipeline slot (seconds / (m + p − 1), the bubble taken out): "
                 f"MT-NLG {pair['factor']:.2f}× slower ({pair['per_sequence']:.2f}× per sequence per pipeline), "
                 f"a gap no model of the hardware closes — its rows stay checks that miss")
    return "\n".join(lines)

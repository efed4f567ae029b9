"""Chapter 11's arithmetic at GPT-3 175B's layer (Korthikanti et al. 2022's count, 16-bit values, 1-byte
masks, one sequence): what each recompute mode keeps and adds, √n checkpointing (Chen et al. 2016), and three
counts of selective recomputation's extra FLOPs. Nothing here runs a model."""
from __future__ import annotations

import math

from minipar.activations import activation_bytes_formula
from minipar.recompute import MODES

from . import claims

GPT3 = dict(s=2048, h=12288, a=96)          # GPT-3 175B's layer, one sequence (b = 1), the paper's 16-bit bytes


def _gpt3_layer_flops() -> float:
    s, h = GPT3["s"], GPT3["h"]
    return 72 * s * h * h * (1 + s / (6 * h))          # forward + backward FLOPs of one layer


def show_three_counts() -> None:
    """Selective recomputation's extra FLOPs at GPT-3's layer, counted three ways."""
    s, h, layer = GPT3["s"], GPT3["h"], _gpt3_layer_flops()
    for name, extra in (("measured here (QKᵀ)", 2 * s * s * h), ("one core forward", 4 * s * s * h),
                        ("Korthikanti et al.", 12 * s * s * h)):
        print(f"{name:>20}: +{extra / layer:.1%} of a layer's step FLOPs")
    claims.check_attention_share_of_flops(s, h, layer)


def show_gpt3_dial() -> None:
    s, h, a, layer = GPT3["s"], GPT3["h"], GPT3["a"], _gpt3_layer_flops()
    kept = {mode: activation_bytes_formula(s, 1, h, a, recompute=mode) for mode in MODES}   # 2-byte values, 1-byte masks
    extra = {"none": 0, "selective": 2 * s * s * h, "full": layer / 3}   # QKᵀ again; one forward again (a step is 3)
    print(f"{'mode':10}{'MiB per layer':>14}{'none ÷ this':>13}{'+ step FLOPs':>14}")
    for mode in MODES:
        print(f"{mode:10}{kept[mode] / 2 ** 20:14.0f}{kept['none'] / kept[mode]:12.1f}×{extra[mode] / layer:14.1%}")
    print(f"selective's {extra['selective'] / layer:.1%}: PyTorch's early-stopping checkpoint (QKᵀ again); "
          f"Megatron's (the attention core's forward again) {4 * s * s * h / layer:.1%} (Deeper A)")
    stages, layers = 8, 96 // 8          # 1F1B, pipeline stage 0 of 8: 12 layers, up to 8 micro-batches in flight
    print(f"1F1B stage 0 of PP {stages} ({layers} layers, {stages} micro-batches in flight): "
          + ", ".join(f"{mode} {kept[mode] * layers * stages / 2 ** 30:.1f} GiB" for mode in MODES))
    claims.check_gpt3_dial(kept, extra, layer)


def show_gpt3_logits(vocabs=(50257, 150000)) -> None:
    """§1's scale line, by formula: GPT-3's FP32 log-probabilities (what the loss keeps)
    for one sequence, 4·s·V bytes, beside one layer's
    linear activations in 16 bits, 34·sbh (Korthikanti et al. 2022), at GPT-3's vocabulary and at 150k."""
    s, h = GPT3["s"], GPT3["h"]
    layer = 34 * s * h
    print(f"At GPT-3 scale, by formula (s = {s}, h = {h:,}, one sequence): one layer's linear part (16-bit) "
          f"34·sbh = {layer / 2 ** 20:.0f} MiB")
    for vocab in vocabs:
        print(f"  V = {vocab:>7,}: FP32 log-probs 4·s·V = {4 * s * vocab / 2 ** 20:5.0f} MiB = "
              f"{4 * s * vocab / layer:.1f}× that layer's linear part")
    claims.check_logits_against_a_layer(s, h)


def show_segments(n_layers: int = 96, ks=(1, 2, 4, 10)) -> None:
    """Chen et al. 2016 on GPT-3's layers: keep only every k-th layer's input and recompute a whole segment
    of k layers in backward (one extra forward, whatever k). Peak ≈ ⌈n/k⌉ · input + k · a layer's activations,
    smallest at k = √(n · input / layer); a layer's activations as kept without and with selective recomputation.
    With selective inside, the layer being differentiated also rebuilds its s² terms (P, its mask, its dropout
    output) for its own backward: one layer's s² bytes on top, whatever k."""
    s, h, a = GPT3["s"], GPT3["h"], GPT3["a"]
    layer_input = activation_bytes_formula(s, 1, h, a, recompute="full")        # 2·sbh
    kept = {mode: activation_bytes_formula(s, 1, h, a, recompute=mode) for mode in ("none", "selective")}
    rebuilt = {"none": 0, "selective": kept["none"] - kept["selective"]}       # 5as²b: one layer's s² terms
    print(f"{n_layers} GPT-3 layers, a checkpoint every k layers: peak activations (by formula)")
    peaks = {}
    for mode in ("none", "selective"):
        def peak(k):
            return math.ceil(n_layers / k) * layer_input + k * kept[mode] + rebuilt[mode]
        peaks[mode] = {k: peak(k) for k in ks}
        best_peak, best = min((peak(k), k) for k in range(1, n_layers + 1))
        label = {"none": "without selective inside", "selective": "with selective inside"}[mode]
        print(f"  {label:24} (a layer keeps {kept[mode] / layer_input:4.1f}× its input): "
              + ", ".join(f"k = {k}: {p / 2**30:4.1f} GiB" for k, p in peaks[mode].items())
              + f"  (best k = {best}: {best_peak / 2**30:.1f} GiB)")
    print(f"  with selective inside, each peak includes the s² terms ({rebuilt['selective'] / 2**30:.3f} GiB, "
          f"{rebuilt['selective'] / layer_input:.0f}× a layer's input) that one layer rebuilds during its own backward")
    claims.check_segments(peaks, n_layers, kept, rebuilt["selective"], layer_input)

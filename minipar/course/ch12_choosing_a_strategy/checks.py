"""Checks for chapter 12's exercises.

1. ``memory_per_device(model, layout)``: the learner predicts the model states and the activations of one
   device of the first pipeline stage (embeddings left out), from the formulas of chapters 03-06 and 11.
   The check compares with the same sum made from :mod:`minipar.plan` on several layouts, and names the
   mistake when the answer equals a known wrong one.
2. ``pick_layout(model, cluster, global_batch)``: the learner returns a :class:`minipar.plan.Layout` and a
   justification ``{"memory_gb": ..., "step_s": ...}``. The layout must be valid, use every device and the
   global batch, fit in memory, keep TP in a node, not mix PP with ZeRO-2/3, and be within the tie band
   of the planner's fastest step time (``Plan.tie``, 10 %: chapter 12 §4's "closer than this, equal"); the justification's numbers must be the cost model's for that layout (±5 %).
"""
from __future__ import annotations

from minipar.course.checks import fail
from minipar.machine.cluster import NVLINK3, LinkCard, gpu_cluster
from minipar.machine.device import A100_SXM_40GB
from minipar.plan import (Layout, Transformer, activation_bytes_per_layer, estimate, in_flight,
                          layer_parameters, model_state_bytes_formula, plan)

__all__ = ["expected_memory", "MEMORY_CASES", "check_memory_per_device", "PICK_MODEL", "PICK_CLUSTER",
           "PICK_BATCH", "check_pick_layout"]


def expected_memory(model: Transformer, layout: Layout) -> dict:
    """Model states and activations of one device of the first stage, embeddings left out."""
    layers = model.layers // layout.pp
    params = layers * layer_parameters(model, layout.tp)
    states = model_state_bytes_formula(params, layout.dp, layout.zero)["total"]
    flying = in_flight(layout.schedule, layout.pp, layout.micro_batches, layout.v) if layout.pp > 1 else 1
    acts = layers * flying * activation_bytes_per_layer(model, layout.micro_batch, layout.tp, layout.sp,
                                                        layout.recompute)
    return {"model_states": states, "activations": acts}


GPT_13B = Transformer(layers=40, hidden=5120, heads=40, vocab=51200, seq_len=2048)
MEMORY_CASES = [
    (GPT_13B, Layout(dp=64)),
    (GPT_13B, Layout(dp=64, zero=1, recompute="full", micro_batch=2)),
    (GPT_13B, Layout(dp=8, tp=8, sp=True, recompute="selective")),
    (GPT_13B, Layout(dp=4, tp=4, pp=4, micro_batches=16)),
    (GPT_13B, Layout(dp=2, tp=8, pp=4, v=2, schedule="interleaved", sp=True, zero=1, micro_batches=8)),
    (GPT_13B, Layout(dp=2, tp=2, pp=8, schedule="gpipe", micro_batches=16, recompute="full")),
]


def _wrong_memory(model, layout) -> dict:
    """Plausible wrong answers, each with the mistake it shows."""
    right = expected_memory(model, layout)
    layers = model.layers // layout.pp
    wrong = {}
    full_layers = layers * layer_parameters(model, 1)
    wrong["model states not divided by tp (each TP rank holds 1/t of the matmul weights)"] = (
        model_state_bytes_formula(full_layers, layout.dp, layout.zero)["total"], right["activations"])
    wrong["ZeRO ignored: the optimizer states (and with ZeRO-2/3 the gradients, parameters) are split over dp"] = (
        model_state_bytes_formula(layers * layer_parameters(model, layout.tp), 1, 0)["total"], right["activations"])
    if layout.pp > 1:
        per = activation_bytes_per_layer(model, layout.micro_batch, layout.tp, layout.sp, layout.recompute)
        wrong["m micro-batches in flight: that is GPipe; 1F1B keeps at most p on the first stage"] = (
            right["model_states"], layers * layout.micro_batches * per)
        wrong["one micro-batch in flight: the first stage holds the activations of every micro-batch whose "
              "backward has not come back yet"] = (right["model_states"], layers * per)
    if layout.sp:
        wrong["SP ignored: with sequence parallelism the LayerNorm and dropout activations are split too"] = (
            right["model_states"], right["activations"] / activation_bytes_per_layer(
                model, layout.micro_batch, layout.tp, True, layout.recompute) * activation_bytes_per_layer(
                model, layout.micro_batch, layout.tp, False, layout.recompute))
    if layout.recompute != "none":
        wrong["recomputation ignored: it changes what each layer keeps (full: only its input)"] = (
            right["model_states"], right["activations"] / activation_bytes_per_layer(
                model, layout.micro_batch, layout.tp, layout.sp, layout.recompute) * activation_bytes_per_layer(
                model, layout.micro_batch, layout.tp, layout.sp, "none"))
    return wrong


def _close(a, b, rel=1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


def check_memory_per_device(fn) -> None:
    for model, layout in MEMORY_CASES:
        got = fn(model, layout)
        if not isinstance(got, dict) or set(got) != {"model_states", "activations"}:
            fail(f"memory_per_device(GPT 13B, {layout})", "a dict {'model_states': bytes, 'activations': bytes}",
                 got, "return both terms, in bytes")
        want = expected_memory(model, layout)
        if all(_close(got[k], want[k]) for k in want):
            continue
        mistake = "compare each term with the formulas of chapters 03 (ZeRO), 05-06 (TP, SP), 04 (in flight), 11"
        for why, (states, acts) in _wrong_memory(model, layout).items():
            if _close(got["model_states"], states) and _close(got["activations"], acts):
                mistake = why
                break
        gb = lambda d: {k: f"{v / 1e9:.3f} GB" for k, v in d.items()}  # noqa: E731
        fail(f"memory per device of the first stage, GPT 13B, {layout}", gb(want), gb(got), mistake)
    print(f"memory_per_device: right for all {len(MEMORY_CASES)} layouts")


PICK_MODEL = Transformer(layers=40, hidden=5120, heads=32, vocab=51200, seq_len=2048)    # 13 B, 32 heads of 160
# slow links between nodes: 100 Gb/s a GPU (latency and efficiency: round numbers, as the other link cards')
SLOW_NETWORK = LinkCard("100 Gb/s a GPU between nodes", 12.5e9, 10e-6, 0.90, "the exercise's slow network")
PICK_CLUSTER = gpu_cluster(A100_SXM_40GB, 4, NVLINK3, SLOW_NETWORK)         # 4 nodes of 8 A100 40 GB, the cards
PICK_BATCH = 256


def check_pick_layout(fn) -> None:
    model, cluster, batch = PICK_MODEL, PICK_CLUSTER, PICK_BATCH
    out = fn(model, cluster, batch)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Layout) and isinstance(out[1], dict)):
        fail("pick_layout(...)", "(Layout(...), {'memory_gb': ..., 'step_s': ...})", out,
             "return the layout and the numbers that justify it")
    layout, why = out
    try:
        e = estimate(model, cluster, layout)
    except ValueError as exc:
        fail("your layout", "a layout the model can run with", layout, str(exc))
    if layout.devices != cluster.devices:
        fail("devices used", cluster.devices, layout.devices, "dp·tp·pp must use every device of the cluster")
    if layout.global_batch != batch:
        fail("global batch = dp · micro_batch · micro_batches", batch, layout.global_batch,
             "keep the global batch: it is the training recipe, not a knob of the layout")
    if layout.tp > cluster.devices_per_node:
        fail("tensor-parallel degree", f"≤ {cluster.devices_per_node} (one node)", layout.tp,
             f"TP all-reduces twice per layer per pass; across nodes they run at "
             f"{cluster.inter_bw / 1e9:g} GB/s instead of {cluster.intra_bw / 1e9:g} GB/s")
    if layout.pp > 1 and layout.zero >= 2:
        fail("ZeRO stage with a pipeline", "0 or 1", layout.zero,
             "a pipeline accumulates gradients over micro-batches; ZeRO-2/3 reduce-scatter them every "
             "micro-batch, and ZeRO-3 also re-gathers its parameters (chapter 08 §5)")
    if not e.fits:
        fail("memory per device", f"≤ {cluster.memory_bytes / 1e9:.0f} GB", f"{e.memory['total'] / 1e9:.1f} GB",
             "shard more: ZeRO-1 for the optimizer states, TP or PP for the parameters, recomputation or SP "
             "for the activations")
    planned = plan(model, cluster, batch, top=1)
    best = planned.fastest
    if e.step_seconds > (1 + planned.tie) * best.step_seconds:
        worst = max((k for k in e.time if k not in ("total", "compute")), key=lambda k: e.time[k])
        fail("step time", f"within {planned.tie * 100:.0f} % of {best.step_seconds:.3g} s (the planner's fastest: {best.layout})",
             f"{e.step_seconds:.3g} s", f"your largest overhead is '{worst}' ({e.time[worst]:.3g} s): reduce it")
    for key, value in (("memory_gb", e.memory["total"] / 1e9), ("step_s", e.step_seconds)):
        if key not in why or not isinstance(why[key], (int, float)) or abs(why[key] - value) > 0.05 * value:
            fail(f"justification['{key}']", f"{value:.3g} (the cost model's, ±5 %)", why.get(key),
                 "justify with the estimate of the layout you picked: minipar.plan.estimate(model, cluster, layout)")
    print(f"pick_layout: {layout} fits ({e.memory['total'] / 1e9:.1f} GB) and takes {e.step_seconds:.3g} s, "
          f"{e.step_seconds / best.step_seconds:.2f}× the planner's fastest")


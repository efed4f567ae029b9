"""The two sums of the cost model (:func:`minipar.plan.estimate`), on one device: memory and step time.

Sources: activations per layer, Korthikanti et al. 2022, Table 2; model states, Rajbhandari et al. 2020;
the bubble, chapter 04 (Narayanan et al. 2021 for the interleaved schedule)."""
from __future__ import annotations

from minipar.pipeline.schedules import bubble_formula

__all__ = ["device_memory", "step_time"]


def device_memory(states: dict, per_layer: float, layers: int, in_flight: float, buffers: float, *,
                  extra: float = 0.0, persistent_grads: bool = True) -> dict:
    """memory = model states + activations + buffers, where activations = (one layer's bytes × layers per stage
    + ``extra``, the output layer's logits on the last stage) × micro-batches in flight. Gradients that do not
    outlive the step (``persistent_grads=False``) only add what exceeds the activations they replace."""
    activations = (per_layer * layers + extra) * in_flight
    grads = states["grads"] if persistent_grads else max(0.0, states["grads"] - activations)
    terms = {"params": states["params"], "grads": grads, "optimizer": states["optimizer"],
             "activations": activations, "buffers": buffers}
    return {**terms, "total": sum(terms.values())}


def step_time(compute: float, collectives: dict, layout) -> dict:
    """time = compute + bubble + each collective's exposed seconds. The bubble is the pipeline's idle share
    f = bubble_formula(schedule, p, m, v) of a stage's whole work: (compute + tp, cp, ep collectives) · f/(1 − f)."""
    p, m, v = layout.pp, layout.micro_batches, layout.v
    f = bubble_formula(layout.schedule, p, m, v) if p > 1 else 0.0
    staged = compute + sum(collectives.get(k, 0.0) for k in ("tp", "cp", "ep"))
    return {"compute": compute, "bubble": staged * f / (1 - f), **collectives}

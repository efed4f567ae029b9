"""Chapter 09b §1: the OneFlow article's 64 × 6 × 8 layout, costed from the formulas for GPT-3 175B and for the
1T model of Narayanan et al. 2021's Table 1 (whose layout it is). Formulas, not runs."""
from __future__ import annotations

from minipar.activations import activation_bytes_formula
from minipar.course.report import Report
from minipar.pipeline.schedules import bubble_formula

__all__ = ["SEED_001_MODELS", "seed_layout", "seed_layouts", "layout_memory_formula"]


def layout_memory_formula(psi: float, *, dp: int, pp: int, tp: int, bytes_per_parameter: int = 16) -> float:
    """Model-state bytes per GPU when Ψ splits evenly over pp·tp (mixed-precision Adam: 2 + 2 + 12 bytes per
    parameter, Rajbhandari et al. 2020)."""
    return psi / (pp * tp) * bytes_per_parameter


# (layers, hidden, heads, sequence, global batch in sequences, parameters)
SEED_001_MODELS = {
    "GPT-3 175B": (96, 12288, 96, 2048, 1536, 175e9),          # Brown et al. 2020 (3.2M tokens per batch)
    "1T": (128, 25600, 160, 2048, 3072, 1008e9),               # Narayanan et al. 2021, Table 1, last row
}


def seed_layout(model: str = "1T", m: int | None = None, recompute: bool = True) -> dict:
    """A model of :data:`SEED_001_MODELS` on the OneFlow article's layout: 64 pipeline stages × 6 hosts in data parallel ×
    8 GPUs in model parallel = 3072 GPUs (the layout of Narayanan et al.'s 1T row, which the seed calls
    GPT-3's). ``m`` micro-batches per replica (default: micro-batch of one sequence). Formulas, not a run."""
    layers, h, a, s, batch, psi = SEED_001_MODELS[model]
    pp, dp, tp = 64, 6, 8
    m = m or batch // dp
    per_stage_max = -(-layers // pp)                         # 96 layers on 64 stages: some get 2, some 1
    psi_layer = 12 * h * h
    mb = batch // (dp * m)
    act_layer = activation_bytes_formula(s, mb, h, a, t=tp)     # Korthikanti et al., 16-bit, TP without SP
    in_flight = pp                                           # 1F1B: stage 0 holds p micro-batches
    act = in_flight * per_stage_max * (2 * s * mb * h if recompute else act_layer)
    states = per_stage_max * psi_layer / tp * 16
    return {"gpus": pp * dp * tp, "layers_per_stage": (layers / pp, per_stage_max), "micro_batch": mb, "m": m,
            "model_states_per_gpu": states,
            "model_states_per_gpu_zero1": per_stage_max * psi_layer / tp * (4 + 12 / dp),
            "activations_per_gpu": act, "bubble": bubble_formula("1f1b", pp, m), "psi": psi,
            "even_split_states": layout_memory_formula(psi, dp=dp, pp=pp, tp=tp)}


def _check_seed(r: Report) -> None:
    one_t, gpt3 = r.layouts["1T"], r.layouts["GPT-3 175B"]
    assert one_t["gpus"] == 3072 and one_t["layers_per_stage"] == (2, 2) and gpt3["layers_per_stage"] == (1.5, 2)
    assert one_t["model_states_per_gpu"] + one_t["activations_per_gpu"] < 80e9      # fits an 80 GB A100


def seed_layouts() -> Report:
    """§1: the OneFlow article's 64 × 6 × 8 layout for GPT-3 175B and for the 1T model (formulas, not runs)."""
    layouts = {name: seed_layout(name) for name in SEED_001_MODELS}
    lines = []
    for name, g in layouts.items():
        lines += [f"{name}: {g['gpus']} GPUs; layers per stage {g['layers_per_stage'][0]:g} on average, "
                  f"{g['layers_per_stage'][1]} on the busiest; micro-batch {g['micro_batch']} sequence, m = {g['m']} per replica",
                  f"    1F1B bubble (p−1)/(m+p−1) = {g['bubble']:.1%}; model states per GPU (busiest stage, mixed-precision "
                  f"Adam) {g['model_states_per_gpu'] / 2**30:.1f} GiB, with ZeRO-1 over the 6 replicas "
                  f"{g['model_states_per_gpu_zero1'] / 2**30:.1f} GiB",
                  f"    activations on stage 0 (p = 64 micro-batches in flight, full recomputation): "
                  f"{g['activations_per_gpu'] / 2**30:.1f} GiB"]
    return Report("\n".join(lines), _check_seed, layouts=layouts)

"""Chapter 09's dropless section: the padded expert-parallel layer (:mod:`minipar.moe.expert_parallel`, cf 1.25)
and the dropless one (:mod:`minipar.moe.dropless`) in one 4-rank launch (ep 4), on the tour's planted worst case
(every token's choice is expert 0: :func:`~minipar.course.ch09_mixture_of_experts.tour.planted_recipe`).

Per layer kind: tokens dropped over the run (all ranks, both MoE layers, 3 steps), max |Δ| of the parameters
against one device training the MoE that keeps every token (float32), and the all-to-all bytes per rank per step
from the comm log beside the formula — padded: 2 directions × 2·k·cf·T·M·b × (ep−1)/ep per layer, whatever
the routing; dropless: the rows really routed (:func:`~minipar.moe.dropless.predicted_exchange_bytes`) plus the
split sizes. :func:`check` raises when dropless drops a token or misses one device, or padded drops none.
"""
from __future__ import annotations

import torch

from minipar import comm
from minipar.check import compare
from minipar.launcher import launch
from minipar.moe import dropless, expert_parallel as epm
from minipar.course.ch09_mixture_of_experts.tour import BATCH, EP, SEQ, planted_recipe

__all__ = ["PADDED_CF", "run", "table_text", "check"]

PADDED_CF = 1.25
LAYERS = {"padded": epm, "dropless": dropless}


def _both(rank, world_size, recipes: dict):
    out = {}
    for name, recipe in recipes.items():
        step_log, routings = comm.CommLog(), []
        result = LAYERS[name].parallel_train(rank, world_size, recipe, ep=EP, step_log=step_log, routings=routings)
        sent = step_log.select(op="all_to_all", dims=("ep",)).bytes_sent / recipe.steps
        out[name] = (result, sum(d for layers in routings for _, d in layers), sent)
    return out


def _formula(recipe, name: str) -> float:
    """All-to-all bytes per rank per step, the mean over ranks, both MoE layers."""
    model = recipe.model()
    layers, width, experts = len(model.moe_layers()), model.cfg.n_embd, model.moe.experts
    tokens = BATCH // EP * SEQ                       # T per rank (ep = world size: no data-parallel copies)
    if name == "padded":
        per_layer = epm.predicted_all_to_all_bytes(tokens, width, model.moe, EP)["formula"]
        return layers * 2 * per_layer * (EP - 1) / EP
    counts = torch.zeros(EP, experts, dtype=torch.long)
    counts[:, 0] = tokens                            # the planted routing: every rank's T tokens to expert 0
    exchange = dropless.predicted_exchange_bytes(counts, width, EP)
    rows = 2 * (exchange["dispatch"] + exchange["combine"]).double().mean()     # forward + backward
    return layers * (float(rows) + experts * 8 * (EP - 1) / EP)                  # + the split sizes (int64)


def run() -> dict:
    """{"padded" | "dropless": {"dropped", "diff", "matches", "sent", "formula"}} from one launch."""
    recipes = {"padded": planted_recipe(False, PADDED_CF), "dropless": planted_recipe(True)}
    dropless.validate(recipes["dropless"], world_size=EP, ep=EP)
    epm.validate(recipes["padded"], world_size=EP, ep=EP)
    reference, _ = epm.loss_free_reference(recipes["dropless"])     # one device, every token kept
    per_rank = launch(_both, EP, recipes, quiet=True)
    table = {}
    for name, recipe in recipes.items():
        c = compare(reference, [r[name][0] for r in per_rank])
        table[name] = {"dropped": sum(r[name][1] for r in per_rank), "diff": c.max_abs_diff, "matches": c.matches,
                       "sent": sum(r[name][2] for r in per_rank) / EP, "formula": _formula(recipe, name)}
    return table


def table_text(table: dict) -> str:
    lines = [f"{'layer':22}{'tokens dropped':>15}{'max |Δ| vs 1 device':>21}{'all-to-all/rank/step':>22}"
             f"{'formula':>10}"]
    for name, row in table.items():
        label = f"padded, cf {PADDED_CF:g}" if name == "padded" else "dropless"
        lines.append(f"{label:22}{row['dropped']:>15}{row['diff']:>21.2g}{row['sent'] / 1024:>21.1f}K"
                     f"{row['formula'] / 1024:>9.1f}K")
    return "\n".join(lines)


def check(table: dict) -> None:
    """Raise unless dropless keeps every token and equals one device, padded drops, and the bytes match."""
    d, p = table["dropless"], table["padded"]
    if d["dropped"] or not d["matches"]:
        raise AssertionError(f"dropless: {d['dropped']} dropped, matches one device = {d['matches']} ({d['diff']:.3g})")
    if not p["dropped"] or p["matches"]:
        raise AssertionError(f"padded cf {PADDED_CF}: {p['dropped']} dropped, matches one device = {p['matches']}")
    for name, row in table.items():
        if abs(row["sent"] - row["formula"]) > 1e-6 * row["formula"]:
            raise AssertionError(f"{name}: {row['sent']} all-to-all bytes per rank per step, formula {row['formula']}")

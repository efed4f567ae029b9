"""Chapter 03's printed tables: each function takes what a run returned, computes the rows the chapter prints
and returns a :class:`minipar.course.report.Report` (the text, its numbers by name, and ``check()``: what
the chapter's text says about them, asserted), so that the chapter's cell is one call.

* :func:`prefetch` — ZeRO-3 with and without prefetch: measured here, replayed here, on a DGX-A100 node and
  GPT-2-sized there (replays are a model);
* :func:`stages` — every ZeRO stage's model-state bytes per rank and bytes sent per step, measured beside the
  ZeRO paper's formulas (Rajbhandari et al. 2020: (2 + 2 + K)Ψ, sharded by stage), and each stage against one
  device and against DDP;
* :func:`designs_table` — one flat buffer per unit against one shard per parameter (FSDP2);
* :func:`calculator_text` — the model-state calculator's lines (:mod:`minipar.data.zero_memory`).
"""
from __future__ import annotations

from minipar.check import RunResult, compare
from minipar.course import replays
from minipar.course.report import Report
from minipar.data import zero_memory
from minipar.data.zero_memory import GB, GiB, bytes_sent_per_step, model_state_bytes_formula
from minipar.machine.cluster import a100_cluster, this_machine

from . import timing

__all__ = ["prefetch", "stages", "designs_table", "calculator_text"]

GPT2_WIDTH = 768     # GPT-2 small's width


def _check_prefetch(r: Report) -> None:
    assert replays.hidden_share(r.without) < 0.05 < replays.hidden_share(r.with_p)   # without prefetch: nothing
    assert replays.exposed_per_step(r.with_p) < replays.exposed_per_step(r.without)


def prefetch(t3: dict, world_size: int = 4) -> Report:
    """``t3`` = ``timing.measure(world_size)``: per run (prefetch, no prefetch) the wall clock here, the replay
    here and on a DGX-A100 node, and GPT-2-sized on it (messages × f, FLOPs × f·k, operator bytes × k·w)."""
    here = this_machine(t3["alpha"], t3["beta"], t3["flops_here"], devices=world_size)
    recipe = timing.STEP_RECIPE
    f = replays.GPT2_SMALL_PARAMS / (t3["param_bytes"] / 4)
    k = replays.SEED_TOKENS_PER_GPU / (recipe["batch_size"] * recipe["seq_len"] // world_size)
    w = GPT2_WIDTH / recipe["n_embd"]
    small = replays.replays(t3, {"here": here, "dgx": a100_cluster(1)})
    big = replays.replays(t3, {"dgx": a100_cluster(1)}, compute_factor=f * k, bytes_factor=f, op_bytes_factor=k * w)
    lines = [f"{'ZeRO-3':13}{'measured here ms':>17} | {'model: replay here ms':>22} {'hidden':>7} | "
             f"{'model: DGX-A100 µs':>19} | {'model: DGX-A100, GPT-2-sized ms':>32} {'exposed ms':>11} {'hidden':>7}"]
    for name in t3["traces"]:
        h, d, b = small["here"][name], small["dgx"][name], big["dgx"][name]
        lines.append(f"{name:13}{t3['measured'][name] * 1e3:>17.1f} | {h.step_between('step') * 1e3:>22.1f} "
                     f"{replays.hidden_share(h):>7.0%} | {d.step_between('step') * 1e6:>19.1f} | "
                     f"{b.step_between('step') * 1e3:>32.2f} {replays.exposed_per_step(b) * 1e3:>11.2f} "
                     f"{replays.hidden_share(b):>7.0%}")
    with_p, without = big["dgx"]["prefetch"], big["dgx"]["no prefetch"]
    return Report("\n".join(lines), _check_prefetch, small=small, big=big, with_p=with_p, without=without,
                  hidden_share=replays.hidden_share(with_p))


def _check_stages(r: Report) -> None:
    assert all(r.ok) and all(len(a) == 1 for a in r.activations)   # measured == formula; same activations
    assert 1e-6 < max(r.diffs) < 1e-4        # §3's text and Q5: rounding, not zero, within 1 % of an Adam step


def stages(per_rank: list, reference: RunResult, world_size: int) -> Report:
    """``per_rank`` = the ranks' {stage: result} from ``figures.measure_stages_with_activations``: per stage the
    model states (KiB per rank) beside the formula, activations, bytes sent per step beside the formula, and the
    largest difference from one device; each stage must also equal DDP bit for bit."""
    n = world_size
    measured = per_rank[0]
    ddp = RunResult(measured[0].losses, measured[0].params)
    psi, padded = measured[0].numel, measured[0].padded_numel
    lines = [f"Ψ = {psi} parameters ({padded} after padding each unit to a multiple of N = {n}); KiB per rank\n",
             f"{'':8}{'params':>9}{'grads':>9}{'optim':>9}{'total':>9}{'formula':>9}{'activ.':>9}"
             f"{'sent/step':>11}{'formula':>9}  vs one device"]
    ok, diffs = [], []
    for stage, res in measured.items():
        want = model_state_bytes_formula(padded, n, stage, "fp32")
        got = [res.memory[k] for k in ("params", "grads", "optimizer")]
        sent, sent_formula = res.bytes_sent[-1], bytes_sent_per_step(padded, n, stage, "fp32")
        # Adam divides by sqrt(v): on near-zero gradients it magnifies the different order in which the ranks'
        # gradients are summed. Tolerance: 1e-4 absolute, 1% of one Adam step (lr = 1e-2) ...
        check = compare(reference, [r[stage] for r in per_rank], atol=1e-4, rtol=1e-3)
        # ... while sharding itself changes nothing: every ZeRO stage equals DDP bit for bit.
        same_as_ddp = compare(ddp, [r[stage] for r in per_rank], atol=0, rtol=0)
        diffs.append(check.max_abs_diff)
        ok.append(check.matches and same_as_ddp.matches and sent == sent_formula
                  and got == [want[k] for k in ("params", "grads", "optimizer")])
        lines.append(f"{zero_memory.STAGE_NAMES[stage]:8}"
                     + "".join(f"{x / 1024:>8.0f}K" for x in got + [sum(got), want['total']])
                     + f"{res.memory['activations'] / 1024:>8.0f}K{sent / 1024:>10.0f}K{sent_formula / 1024:>8.0f}K"
                     f"  max |Δ| {check.max_abs_diff:.1e}")
    lines.append(f"largest difference from one device, any stage: {max(diffs):.1e}")
    activations = [{res.memory["activations"] for res in r.values()} for r in per_rank]
    zero2 = measured[2].memory
    return Report("\n".join(lines), _check_stages, measured=measured, psi=psi, padded=padded, ok=ok, diffs=diffs,
                  activations=activations, zero2_states=zero2["params"] + zero2["grads"] + zero2["optimizer"],
                  zero2_formula=int(model_state_bytes_formula(padded, n, 2, "fp32")["total"]))


def _check_designs(r: Report) -> None:
    assert all(r.agree.values())
    assert all(row["sent"] == row["formula"] and row["gathers"] == 2 * row["units"]
               and row["reduce_scatters"] == row["units"] for row in r.rows.values())
    (flat_n, flat_p), (per_n, per_p) = r.sizes["flat"], r.sizes["per-parameter"]
    assert flat_n == per_n and flat_p - flat_n < per_p - per_n
    assert all(len(shape) == 1 for shape, _ in r.flat_grads) and all(g == s for s, g in r.per_grads)


def designs_table(both: dict, reference: RunResult, world_size: int) -> Report:
    """``both`` = ``designs.run(world_size)``: per design the elements, padded elements, collectives and bytes
    sent per step (the log) beside 3(N−1)/N · 8 B · padded, and the largest difference from one device."""
    n = world_size
    lines = [f"{'design':14} {'elements':>9} {'padded':>7} {'gathers':>8} {'reduce-scatters':>16} "
             f"{'sent/step (log)':>16} {'3(N-1)/N·b·padded':>18} {'max |Δ| vs 1 device':>20}"]
    sizes, rows, agree = {}, {}, {}
    for name, per_rank in both.items():
        r = per_rank[0]
        elements, padded = (sum(column) for column in zip(*r["units"]))
        sizes[name] = (elements, padded)
        agreement = compare(reference, [x["result"] for x in per_rank], atol=1e-10, rtol=0)
        agree[name] = agreement.matches
        rows[name] = {"sent": r["per_step"]["all_gather"][1] + r["per_step"]["reduce_scatter"][1],
                      "formula": 3 * (n - 1) / n * 8 * padded, "units": len(r["units"]),
                      "gathers": r["per_step"]["all_gather"][0], "reduce_scatters": r["per_step"]["reduce_scatter"][0]}
        row = rows[name]
        lines.append(f"{name:14} {elements:9,} {padded:7,} {row['gathers']:8} {row['reduce_scatters']:16} "
                     f"{row['sent']:16,.0f} {row['formula']:18,.0f} {agreement.max_abs_diff:20.1e}")
    (flat_n, flat_p), (per_n, per_p) = sizes["flat"], sizes["per-parameter"]
    flat_grads, per_grads = both["flat"][0]["grads"], both["per-parameter"][0]["grads"]
    lines += [f"\nSame {flat_n:,} parameters; padding {flat_p - flat_n} elements flat vs {per_p - per_n} per "
              f"parameter, so per-parameter sharding sends {per_p / flat_p - 1:.1%} more bytes here.",
              f"flat: the loop's parameters (shard shapes): {[s for s, _ in flat_grads]}",
              f"per parameter, the first four (shape, .grad shape): {per_grads[:4]}"]
    return Report("\n".join(lines), _check_designs, sizes=sizes, rows=rows, agree=agree, flat_grads=flat_grads,
                  per_grads=per_grads)


def calculator_text(log10_params: float = 9.0, devices: int = 8, stage: int = 3, unit: str = "GB") -> str:
    """Model-state bytes per device and bytes sent per step for Ψ = 10^log10_params parameters, mixed-precision
    Adam (K = 12), ``devices`` ranks, ZeRO ``stage`` (0: DDP): :func:`minipar.data.zero_memory.model_state_bytes_formula`."""
    psi = 10 ** log10_params
    b = model_state_bytes_formula(psi, devices, stage, "mixed")
    div = GB if unit == "GB" else GiB
    lines = [f"Ψ = {psi:.3g} parameters, N = {devices}, {zero_memory.STAGE_NAMES[stage]} (mixed-precision Adam, K = 12)"]
    lines += [f"  {k:<10}{b[k] / div:10.2f} {unit}" for k in ("params", "grads", "optimizer", "total")]
    lines.append(f"  sent per step {bytes_sent_per_step(psi, devices, stage, 'mixed') / div:.2f} {unit} per device")
    return "\n".join(lines)

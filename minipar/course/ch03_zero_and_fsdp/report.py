"""Chapter 03's printed tables: each function takes what a run returned and returns a :class:`Report` (the
text, its numbers by name, and ``check()``: what the chapter says of them), so that a cell is one call.

* :func:`papers_table` — the ZeRO paper's Figure 1 (Ψ = 7.5 B, N = 64) from the calculator;
* :func:`la_lb_lc` — the Hugging Face guide's three-layer example: what each rank holds, one step's events;
* :func:`break_even` — the tokens per GPU from which prefetch can hide ZeRO-3's gathers (DGX nodes);
* :func:`prefetch` — ZeRO-3 with and without prefetch, replayed GPT-2-sized on a DGX-A100 node (a model);
* :func:`stages` — every ZeRO stage's model-state bytes per rank, measured (and its logged bytes per step,
  checked only) against the ZeRO paper's formulas (Rajbhandari et al. 2020: (2 + 2 + K)Ψ, sharded by stage),
  and each stage against one device and against DDP;
* :func:`wire` — bytes each rank wrote to its sockets (gloo's, minipar's rings, accumulating);
* :func:`prefetch_memory` — the peak live bytes with and without prefetch;
* :func:`fsdp_loop` — ``FSDP(model)`` in a plain loop; :func:`designs_table` — flat buffer against FSDP2's;
* :func:`calculator_text` — the model-state calculator's lines (:mod:`minipar.data.zero_memory`).
"""
from __future__ import annotations


from minipar.check import RunResult, compare, gpt_recipe
from minipar.course import replays
from minipar.course.report import Report, against_one_device
from minipar.data import zero_memory
from minipar.data.zero_memory import GB, GiB, bytes_sent_per_step, model_state_bytes_formula
from minipar.machine.cluster import a100_cluster, h100_cluster
from minipar.observe.busy import run_disturbed

from . import claims, figures, modes, muon_table, paced, timing
from .fsdp_loop import BLOCKS as FSDP_LOOP_BLOCKS

__all__ = ["show", "papers_table", "fsdp_loop", "la_lb_lc", "break_even", "prefetch", "prefetch_memory", "paced_table", "stages", "wire",
           "designs_table", "modes_table", "muon", "calculator_text", "folded"]

GPT2_WIDTH = 768     # GPT-2 small's width


def show(report: Report) -> Report:
    """Print the table and check what the chapter says about it (silent when all holds): one call a cell."""
    print(report)
    report.check()
    return report


def papers_table(psi: float = 7.5e9, n: int = 64) -> Report:
    """The paper's Figure 1 from :func:`minipar.data.zero_memory.table` (GB = 1e9 B), DDP's total in GiB."""
    totals = [model_state_bytes_formula(psi, n, s, "mixed")["total"] / GB for s in range(4)]
    text = (zero_memory.table(psi, n, "mixed", unit="GB")
            + f"\n\nthe same DDP total in GiB: {model_state_bytes_formula(psi, n, 0)['total'] / GiB:.1f} GiB")

    def checks(r):
        claims.check_papers_numbers(totals)
        claims.check_zero3_1b_params_on_8_gpus()      # the calculator's first view (§12): 16 bytes × 1e9 / 8
    return Report(text, checks, totals=totals)


def la_lb_lc(runs: list, reference: RunResult) -> Report:
    """``runs`` = ``figures.run_la_lb_lc()``: what each rank holds between steps, the run against one device,
    and rank 0's gather / free / reduce-scatter events in step 1."""
    agreement = compare(reference, [run["result"] for run in runs])
    step1 = [(kind, layer) for step, kind, layer in runs[0]["events"] if step == 1]
    lines = [f"rank {rank} holds " + ", ".join(f"{name} = {v:.2f}" for layer in run["held"].values()
                                                for name, v in layer) for rank, run in enumerate(runs)]
    lines += [f"trained 3 steps: {against_one_device(agreement)}", "", "rank 0, step 1:"]
    lines += _two_columns(step1, {layer for _, layer in step1})

    def checks(r):
        agreement.assert_ok()
        claims.check_la_lb_lc_example_live(runs)       # rank r holds exactly a_r, b_r, c_r
        for layer in ("La", "Lb", "Lc"):               # gather, free, gather again, reduce-scatter, free
            claims.check_each_layer_gathered_freed_scattered(step1, layer)
    return Report("\n".join(lines), checks, step1=step1)


def _two_columns(events: list, layers: set) -> list:
    """The step's events as forward | backward, one a line: the forward ends once every layer was freed."""
    freed, split = set(), len(events)
    for i, (kind, layer) in enumerate(events):
        freed |= {layer} if kind == "free" else set()
        if freed == layers:
            split = i + 1
            break
    forward, backward = events[:split], events[split:]
    rows = [f"  {'forward':24}backward"]
    for i in range(max(len(forward), len(backward))):
        f = " ".join(forward[i]) if i < len(forward) else ""
        b = " ".join(backward[i]) if i < len(backward) else ""
        rows.append(f"  {f:24}{b}")
    return rows


def paced_table(m: dict) -> Report:
    """``m`` = ``paced.measure(world_size)``: the paced steps with and without prefetch, then what the run is
    evidence of (:func:`.paced.verdict_line`), so §5's prose and the Summary need not assume the machine was quiet."""
    lines = paced.table(m).split("\n")
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("  paced:")), len(lines))
    text = "\n".join(lines[:at] + paced.compute_note(m) + lines[at:] + [paced.verdict_line(m)])

    def checks(r):
        claims.check_prefetch_saves_time_paced(m)
        claims.check_paced_verdict_follows_the_run(m, r.text)
    return Report(text, checks, m=m, busy=run_disturbed(m))


def modes_table(fsdp_modes: dict, world_size: int = 4) -> Report:
    """``fsdp_modes`` = ``modes.run_modes(world_size)``: FSDP's modes as the ZeRO variants they are."""
    full, kept, zero2, hybrid, posted = (fsdp_modes[k] for k in modes.MODES)
    psi, n = modes.parameter_count(), world_size
    between = {name: formula(psi, n) for name, (_, formula) in modes.BETWEEN.items()}
    return Report(modes.table_text(fsdp_modes, n),
                  lambda r: claims.check_fsdp_modes_bytes_and_peaks(fsdp_modes, kept, zero2, full, hybrid, posted,
                                                                    between))


def muon(table: dict) -> Report:
    """``table`` = ``muon_table.run(world_size)``: the four placements of Muon; Muon's own bytes (beyond ZeRO-1's)
    under owner-compute over gather-everywhere's."""
    extra = {m: table[m]["sent"] - table["per_shard"]["sent"] for m in ("gather", "owner")}
    return Report(muon_table.table_text(table), lambda r: muon_table.check(table),
                  owner_over_gather=round(extra["owner"] / extra["gather"], 3))


def _check_prefetch(r: Report) -> None:
    assert replays.hidden_share(r.without) < 0.05 < replays.hidden_share(r.with_p)   # without prefetch: nothing
    assert replays.exposed_per_step(r.with_p) < replays.exposed_per_step(r.without)
    assert replays.exposed_per_step(r.without) < r.without.step_between("step") / 2   # §5: on DGX, compute dominates


def prefetch(t3: dict, world_size: int = 4) -> Report:
    """``t3`` = ``timing.measure_counted(world_size)`` (or ``timing.measure``): per run (prefetch, no prefetch)
    the traced step's counted operators replayed GPT-2-sized on a DGX-A100 node (messages × f, FLOPs × f·k,
    operator bytes × k·w): step, exposed, hidden."""
    recipe = timing.STEP_RECIPE
    f = replays.GPT2_SMALL_PARAMS / (t3["param_bytes"] / 4)
    k = replays.SEED_TOKENS_PER_GPU / (recipe["batch_size"] * recipe["seq_len"] // world_size)
    w = GPT2_WIDTH / recipe["n_embd"]
    big = replays.replays(t3, {"dgx": a100_cluster(1)}, compute_factor=f * k, bytes_factor=f, op_bytes_factor=k * w)
    lines = ["model: ZeRO-3 GPT-2-sized on a DGX-A100 node",
             f"{'ZeRO-3':13}| {'step':>8} {'exposed':>10} {'hidden':>7}"]
    for name in t3["counted"]:
        b = big["dgx"][name]
        lines.append(f"{name:13}| {b.step_between('step') * 1e3:>5.2f} ms {replays.exposed_per_step(b) * 1e3:>7.2f} ms "
                     f"{replays.hidden_share(b):>7.0%}")
    with_p, without = big["dgx"]["prefetch"], big["dgx"]["no prefetch"]
    return Report("\n".join(lines), _check_prefetch, big=big, with_p=with_p, without=without,
                  hidden_share=replays.hidden_share(with_p))


def break_even(world_size: int = 4, node_size: int = 8) -> Report:
    """The tokens per GPU from which a unit's compute covers its all-gather (:func:`break_even_tokens`), from
    its two inputs F and β, at N = ``world_size`` (§14's replay) and N = ``node_size`` (a whole 8-GPU node,
    where (N−1)/N is near 1): on a DGX-A100 node (the node §14's model replays on) and on a DGX H100 node (the
    links chapter 00's Appendix D gives later chapters)."""
    rows = []
    for name, node in (("DGX A100, NVLink 3", a100_cluster(1)), ("DGX H100, NVLink 4", h100_cluster(1))):
        rows.append(f"{name}   F = {node.peak_flops * node.flops_efficiency / 1e12:3.0f} TFLOP/s"
                    f"   β = {node.intra_bw / 1e9:3.0f} GB/s   T ≥ {break_even_tokens(node, world_size):,.0f} "
                    f"at N = {world_size}, {break_even_tokens(node, node_size):,.0f} at N = {node_size}")
    evens = [break_even_tokens(a100_cluster(1), n) for n in (world_size, node_size)]
    text = ("T ≥ (N-1)/N · F/β tokens per GPU; F: the matmuls' rate, β: a ring's rate\n" + "\n".join(rows))
    return Report(text, lambda r: [claims.check_break_even_below_the_models_tokens(e, replays.SEED_TOKENS_PER_GPU)
                                   for e in r.break_evens], break_even=evens[0], break_evens=evens)


def break_even_tokens(cluster, n: int) -> float:
    """Tokens per GPU from which prefetch can hide ZeRO-3's gathers: a unit of Ψ_u 16-bit parameters computes
    its forward in 2·T·Ψ_u/F (F: the FLOP/s reached) and its gather takes (N−1)/N·2Ψ_u/β; the first covers
    the second when T ≥ (N−1)/N·F/β, whatever Ψ_u (backward: twice the compute under a gather and a
    reduce-scatter, the same bound)."""
    return (n - 1) / n * cluster.peak_flops * cluster.flops_efficiency / cluster.intra_bw


def _check_stages(r: Report) -> None:
    assert all(r.ok) and all(len(a) == 1 for a in r.activations)   # measured == formula; same activations
    assert 0 < max(r.diffs) and max(r.vs_ddp) == 0     # §3's text and Q5: rounding vs one device, none vs DDP
    peaks = [r.measured[s].memory["peak"] for s in range(4)]
    assert peaks[3] < peaks[2] < peaks[1] < peaks[0]   # with 8 blocks ZeRO-3's gathered units weigh little
    claims.check_all_four_stages_measured(r.bytes_sent[3] / r.bytes_sent[0])     # ZeRO-3: 1.5x DDP
    assert r.bytes_sent[1] == r.bytes_sent[2] == r.bytes_sent[0]                  # ZeRO-1/2: DDP's bytes


def stages(per_rank: list, reference: RunResult, world_size: int) -> Report:
    """``per_rank`` = the ranks' {stage: result} from ``figures.measure_stages_with_activations``: per stage the
    model states (KiB per rank) beside the formula, activations, the peak during a step, and the largest difference
    from one device (default FP32 tolerance) and from DDP (0); the logged bytes are checked, not printed (§4's)."""
    n = world_size
    measured = per_rank[0]
    ddp = RunResult(measured[0].losses, measured[0].params)
    psi, padded = measured[0].numel, measured[0].padded_numel
    padding = f"; Ψ = {padded:,} after padding each unit to a multiple of N = {n}" if padded != psi else ""
    lines = [f"model states and activations, KiB per rank{padding}\n",
             f"{'mem. KiB':8}{'params':>8}{'grads':>8}{'optim':>8}{'total':>8}{'formula':>8}{'activ.':>8}{'peak':>8}"]
    ok, diffs, vs_ddp, sent_by_stage = [], [], [], []
    for stage, res in measured.items():
        want = model_state_bytes_formula(padded, n, stage, "fp32")
        got = [res.memory[k] for k in ("params", "grads", "optimizer")]
        sent, sent_formula = res.bytes_sent[-1], bytes_sent_per_step(padded, n, stage, "fp32")
        # the default FP32 tolerance: the ranks' gradients are summed in another order than one device's
        check = compare(reference, [r[stage] for r in per_rank])
        same_as_ddp = compare(ddp, [r[stage] for r in per_rank], atol=0, rtol=0)   # sharding changes nothing
        diffs.append(check.max_abs_diff)
        vs_ddp.append(same_as_ddp.max_abs_diff)
        sent_by_stage.append(sent)
        ok.append(check.matches and same_as_ddp.matches and sent == sent_formula
                  and got == [want[k] for k in ("params", "grads", "optimizer")])
        lines.append(f"{zero_memory.STAGE_NAMES[stage]:8}"
                     + "".join(f"{x / 1024:>8.0f}" for x in got + [sum(got), want['total'], res.memory['activations'],
                                                             res.memory['peak']]))
    lines += [f"\nfinal parameters, every stage: max |Δ| vs one device {max(diffs):.1e}, "
                        f"vs DDP {max(vs_ddp):g}"]
    activations = [{res.memory["activations"] for res in r.values()} for r in per_rank]
    zero2 = measured[2].memory
    return Report("\n".join(lines), _check_stages, measured=measured, psi=psi, padded=padded, ok=ok, diffs=diffs,
                  vs_ddp=vs_ddp, bytes_sent=sent_by_stage, activations=activations,
                  zero2_states=zero2["params"] + zero2["grads"] + zero2["optimizer"],
                  zero2_formula=int(model_state_bytes_formula(padded, n, 2, "fp32")["total"]))


def _check_wire(r: Report) -> None:
    claims.check_trains_like_one_device(r.reference, r.runs, *r.ratios, gloo2=r.gloo2)
    m = figures.ACCUM_STEPS
    claims.check_zero2_reduce_scatters_every_micro_batch(r.logged_ratio, m, figures.root_share(), r.runs,
                                                         figures.accumulation_recipe(len(r.runs)))


def wire(ring_runs: list, per_rank: list, reference: RunResult, world_size: int) -> Report:
    """``ring_runs`` = the ranks' ``figures.rings_and_accumulation``, ``per_rank`` = §3's runs (the ranks'
    ``figures.measure_stages_with_activations``: DDP and ZeRO-1/3 on gloo's collectives): the ring story first
    (bytes the ranks wrote to their sockets on minipar's rings, mean over ranks; under accumulation the log's
    ring-model bytes, rank 0, last step), each as a ratio to DDP's; ``gloo_note``: why gloo's collectives send
    more, with these runs' ratios on gloo (ZeRO-1/2/3 from §3's runs, ZeRO-2 accumulating from this launch), for
    :func:`folded`."""
    wire_runs = [{**rings, "DDP": stages[0], ("gloo", 1): stages[1], ("gloo", 2): stages[2], ("gloo", 3): stages[3]}
                 for rings, stages in zip(ring_runs, per_rank)]
    observed = {k: sum(r[k].bytes_observed[-1] for r in wire_runs) / world_size for k in wire_runs[0]}
    logged = {k: wire_runs[0][k].bytes_sent[-1] for k in wire_runs[0]}
    ratio = {k: observed[k] / observed["DDP"] for k in observed}
    ratios = [ratio[("ring", 1)], ratio[("ring", 3)], ratio[("gloo", 1)], ratio[("gloo", 3)]]
    logged_ratio = {s: logged[("accum", s)] / logged["DDP"] for s in (1, 2)}
    m = figures.ACCUM_STEPS
    measured = [("DDP", observed["DDP"], 1.0),
                ("ZeRO-1", observed[("ring", 1)], ratio[("ring", 1)]),
                ("ZeRO-3", observed[("ring", 3)], ratio[("ring", 3)])]
    formula = [("DDP", logged["DDP"], 1.0),
               ("ZeRO-1", logged[("accum", 1)], logged_ratio[1]),
               ("ZeRO-2", logged[("accum", 2)], logged_ratio[2])]
    lines = []
    for title, rows in (("on the sockets, per rank, last step", measured),
                        (f"m = {m} micro-batches: bytes a ring sends", formula)):
        lines += [f"{title:40}{'KiB':>8}{'× DDP':>8}"]
        lines += [f"  {name:38}{kib / 1024:>8.1f}{x:>7.2f}x" for name, kib, x in rows] + [""]
    lines.pop()
    gloo_note = ("gloo has **no reduce-scatter of its own**: it all-reduces the whole buffer and keeps one chunk, "
                 "moving 2(N−1)/N·S, twice the ring's. So on gloo's collectives ZeRO-1/2 send 1.5× DDP's bytes and "
                 f"ZeRO-3 2×; measured on these runs' sockets: ZeRO-1 {ratio[('gloo', 1)]:.2f}×, ZeRO-2 {ratio[('gloo', 2)]:.2f}×, "
                 f"ZeRO-3 {ratio[('gloo', 3)]:.2f}×, and ZeRO-2 accumulating {m} micro-batches "
                 f"{ratio[('accum', 2)]:.2f}× (each of its reduce-scatters moves an all-reduce's bytes).\n\n"
                 "This is also why §3's stages came out bit-identical to DDP (the 0 there): on gloo, ZeRO's "
                 "reduce-scatter and DDP's all-reduce are the same collective, and on these layouts it summed every "
                 "gradient in the same order. NCCL's reduce-scatter is a different algorithm from its all-reduce: "
                 "there, expect differences at rounding level.")
    return Report("\n".join(lines), _check_wire, reference=reference, runs=wire_runs, ratios=ratios,
                  ring1=ratios[0], logged_ratio=logged_ratio, gloo2=ratio[("gloo", 2)], gloo_note=gloo_note)


def folded(note: str, summary: str):
    """``note`` (markdown, its numbers from the run) as a notebook output under a collapsed ``summary``: a side
    result and its explanation kept off the lesson path, in one fold."""
    from IPython.display import Markdown
    return Markdown(f"<details><summary>{summary}</summary>\n\n{note}\n\n</details>")


def _check_prefetch_memory(r: Report) -> None:
    claims.check_prefetch_buys_hidden_gathers_with_memory(r.extra)


def prefetch_memory(t3: dict) -> Report:
    """Rank 0's peak live bytes in step 2 of ``timing.measure``'s (or ``timing.measure_memory``'s) runs, gathered
    parameters included, and one block's weight matrices (12·d² FP32 elements) and its whole parameters (with
    biases and norms) beside the difference."""
    peaks = {name: max(b for *_, b in t3["memory"][name]) for name in t3["memory"]}
    d, blocks = timing.STEP_RECIPE["n_embd"], timing.STEP_RECIPE["n_layer"]
    block, extra = 12 * d * d * 4, peaks["prefetch"] - peaks["no prefetch"]
    whole = sum(p.numel() * p.element_size()
                for p in gpt_recipe(steps=1, **timing.STEP_RECIPE).model().blocks[0].parameters())
    text = (f"tiny GPT of {blocks} blocks, h = {d}, ZeRO-3 on 4 ranks\npeak live bytes on rank 0: prefetch {peaks['prefetch'] / 2**20:.2f} MiB, without "
            f"{peaks['no prefetch'] / 2**20:.2f} MiB: prefetch holds {extra / 1024:.0f} KiB more "
            f"(one block's weight matrices: {block / 1024:.0f} KiB; with its biases and norms: {whole / 1024:.0f} KiB)")
    return Report(text, _check_prefetch_memory, peaks=peaks, extra=extra)


def fsdp_loop(per_rank: list, reference: RunResult) -> Report:
    """``(per_rank, reference)`` = ``fsdp_loop.run(N)``: minipar's and PyTorch's FSDP, each against one device
    (default FP32 tolerance)."""
    ours, torch_fsdp2 = compare(reference, [o for o, _ in per_rank]), compare(reference, [t for _, t in per_rank])
    steps = f"{len(per_rank)} ranks, §3's GPT at {FSDP_LOOP_BLOCKS} blocks, {len(reference.losses)} Adam steps"
    text = (f"minipar's FSDP(model), {steps}: {against_one_device(ours)}\n"
            f"PyTorch's fully_shard, same units: {against_one_device(torch_fsdp2)}")
    return Report(text, lambda r: (ours.assert_ok(), torch_fsdp2.assert_ok()), agreement=ours)


def _check_designs(r: Report) -> None:
    assert all(r.agree.values())
    assert all(row["sent"] == row["formula"] and row["gathers"] == 2 * row["units"]
               and row["reduce_scatters"] == row["units"] for row in r.rows.values())
    (flat_n, flat_p), (per_n, per_p) = r.sizes["flat"], r.sizes["per-parameter"]
    assert flat_n == per_n and flat_p - flat_n < per_p - per_n
    assert all(len(shape) == 1 for shape, _ in r.flat_grads) and all(g == s for s, g in r.per_grads)


def designs_table(both: dict, reference: RunResult, world_size: int) -> Report:
    """``both`` = ``designs.run(world_size)``: per design the elements, padded elements, collectives and bytes
    the log's ring-model bytes per step beside 3(N−1)/N · 8 B · padded, and the largest difference from one device."""
    n = world_size
    lines = [f"{'design':14} {'elements':>9} {'padded':>7} {'gathers':>8} {'reduce-scatters':>16} "
             f"{'ring model':>16} {'3(N-1)/N·b·padded':>18} {'max |Δ| vs 1 device':>20}"]
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

"""Chapter 04's displays: each prints (or draws) what one cell ran and holds it to the chapter's claims
(:mod:`.claims`), printing nothing more when they hold — so a cell reads ``result = run(...)``, ``show(result)``."""
from __future__ import annotations

import matplotlib.pyplot as plt
from IPython.display import Markdown

from minipar.pipeline import make_schedule, simulate
from minipar.pipeline.runtime import measured_idle_fraction, typical_step

from . import claims
from .figures import draw_measured, draw_memory, paced_idle, peak_held
from .verdicts import ladder_reading, paced_verdict   # the sentences under the paced table and the ladder

__all__ = ["show_runtime_loop", "show_refusal", "show_link", "show_naive", "show_bubble_sweep", "show_batch_arithmetic", "show_pipeline_bytes", "show_latency",
           "show_vs_one_device", "show_same_bubble", "show_held", "show_memory", "compare_memory", "show_pipedream", "show_weight_versions", "show_layout",
           "show_interleaved", "show_interleaved_bytes", "show_beside", "show_unpaced",
           "show_paced", "paced_verdict", "report_paced", "ladder_reading", "show_explorer", "show_1f1b_phases", "show_idle_breakdown"]


def show_runtime_loop():
    """The heart of ``PipelineRank.run``, read live as Markdown: its loop over the actions (the timing and pacing
    hooks and the step's setup left out) and one full backward, which receives, runs autograd and sends."""
    import inspect
    import textwrap
    from minipar.pipeline.runtime import PipelineRank
    lines = textwrap.dedent(inspect.getsource(PipelineRank.run)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("do = {"))
    end = next(i for i, line in enumerate(lines) if line.strip() == "work.wait()")
    loop = [line for line in lines[start:end + 1] if "begin_action" not in line and "action_done" not in line]
    claims.check_runtime_loop_excerpt(loop)
    backward = textwrap.dedent(inspect.getsource(PipelineRank.backward_full)).rstrip()
    return Markdown("```python\n" + "\n".join([lines[0], "    ...", *loop, "", backward]) + "\n```")


def show_refusal(err) -> None:
    """The ValueError a tied model gets before any process starts."""
    print("ValueError:", err)
    claims.check_tied_model_refused(err)


def show_bubble_sweep(p: int, ms=(1, 2, 4, 8, 16, 32)) -> None:
    """GPipe simulated at each m: both bubble conventions beside their formulas."""
    sims = {m: simulate(make_schedule("gpipe", p, m)) for m in ms}
    for m, sim in sims.items():
        print(f"m={m:2d}: idle/total {sim.bubble_fraction:6.1%} (formula (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):6.1%})   "
              f"idle/ideal {sim.bubble_ratio:6.1%} (formula (p-1)/m = {(p - 1) / m:6.1%})")
    claims.check_gpipe_micro_batches_fill_pipe(p, sims)


def show_held(runs: dict, p: int, m: int) -> dict:
    """{schedule: micro-batches held at the peak, per rank}, counted from each rank's recorded actions."""
    held = {s: [peak_held(run) for run in runs[s]] for s in ("gpipe", "1f1b")}
    print("micro-batches held at the peak, per rank (measured: counted from each rank's recorded actions):")
    for s in ("gpipe", "1f1b"):
        print(f"  {s:5s}: {held[s]}   simulated {simulate(make_schedule(s, p, m)).peak_in_flight}")
    return held


def show_memory(memory: dict, held: dict, p: int, m: int) -> None:
    """Peak live KiB per rank of {(schedule, recompute): runs}, printed and drawn."""
    def peak_kib(rs, rank):
        return max(b for _, _, b in rs[rank].memory) / 1024

    for (s, rc), rs in memory.items():
        print(f"{s:5s}{' + recompute' if rc else '            '}: peak live KiB per rank",
              [round(peak_kib(rs, r)) for r in range(p)])
    draw_memory(memory)
    plt.show()
    # the trace records live bytes after each action, so GPipe's first point is one micro-batch's activations:
    # each peak in those units is the micro-batches held plus under three more (gradients, receive buffers)
    one = [memory[("gpipe", False)][r].memory[0][2] / 1024 for r in range(p)]
    units = {s: [round(peak_kib(rs, r) / one[r], 1) for r in range(p)] for (s, rc), rs in memory.items() if not rc}
    claims.check_activations_held_per_stage(held, m, p, peak_kib, memory)
    claims.check_peak_in_micro_batches(units, held)


def compare_memory(reference, runs: dict, p: int, m: int, dtype) -> dict:
    """GPipe, 1F1B and GPipe + recompute (``runs``: {"gpipe", "1f1b", "gpipe + recompute"}) each held equal to one
    device, then the micro-batches each rank held (:func:`show_held`) and its peak live KiB (:func:`show_memory`);
    returns the held counts."""
    from minipar.check import compare
    for name in ("gpipe", "1f1b", "gpipe + recompute"):
        compare(reference, runs[name], dtype=dtype).assert_ok()
    held = show_held(runs, p, m)
    show_memory({("gpipe", False): runs["gpipe"], ("1f1b", False): runs["1f1b"],
                 ("gpipe", True): runs["gpipe + recompute"]}, held, p, m)
    return held


def show_unpaced(shown: dict, p: int, traced=None) -> dict:
    """{(schedule, m, v): runs} → {schedule: measured idle fraction of its median step}, beside the formula, in whole
    percent: one run each, which a rerun on shared cores moves by many points. ``traced`` (an
    :class:`~.timing.IdleBreakdown`): its schedule's row is that traced run's, the step its ladder replays."""
    unpaced = {n: measured_idle_fraction(rs, typical_step(rs)) for (n, m, v), rs in shown.items()}
    if traced is not None:
        unpaced[traced.schedule] = traced.idle["measured"]
    for (n, m, v) in shown:
        run = "the traced run below" if traced is not None and n == traced.schedule else "one run"
        print(f"{n:11s}: formula (simulated) {simulate(make_schedule(n, p, m, v)).bubble_fraction:4.0%}   "
              f"measured unpaced {unpaced[n]:4.0%}  ({run})")
    claims.check_every_schedule_simulated_measured_unpaced(unpaced)
    return unpaced


def show_paced(paced: dict, p: int):
    """The paced runs drawn and tabled beside the formula, then :func:`report_paced`'s verdict; returns the table
    (PacedIdle), whose ``disturbed`` list is empty only when the run is evidence."""
    draw_measured(paced, p)
    plt.show()
    idle = paced_idle(paced, p)
    report_paced(idle)
    return idle


def report_paced(idle) -> None:
    """The paced table and its verdict (:func:`paced_verdict`), held to the chapter's claims."""
    print(idle)
    claims.check_schedules_bubble_within_5_points(idle)   # the schedule's bubble, within 5 points (undisturbed runs)
    text = paced_verdict(idle)
    claims.check_paced_verdict_follows_the_guard(idle, text)
    print(text)


def show_naive(schedule, p: int) -> None:
    print(schedule)
    sim = simulate(schedule)
    print(f"bubble (idle fraction of {p} ranks x makespan): {sim.bubble_fraction:.1%}")
    claims.check_naive_model_parallelism_one_device(sim, p)


def show_batch_arithmetic(mbs: int, chunks: int, dp: int) -> None:
    from minipar.pipeline import bubble_formula
    global_batch = mbs * chunks * dp
    print(f"{mbs} x {chunks} x {dp} = {global_batch};  bubble with p=4 and m=chunks={chunks}: "
          f"{bubble_formula('gpipe', 4, chunks):.1%}")
    claims.check_micro_batch_arithmetic(global_batch, dp, chunks, mbs)


def show_pipeline_bytes(runs: list, reference, p: int, m: int, a: int, steps: int) -> None:
    """Bytes each rank sent per step (the end ranks m·A, the middle ones 2m·A) and their mean beside 2(p-1)·m·A/p,
    and what the same p ranks would send splitting the model by DP or by TP instead (ring model)."""
    per_rank = [r.bytes_sent // steps for r in runs]
    print(f"A = {a:,} B here (float64, 8 bytes a value); the same activation in bf16: {a // 4:,} B")
    sent, formula = sum(per_rank) / p, 2 * (p - 1) * m * a / p
    print(f"bytes sent per step, rank 0..{p - 1}: {per_rank}  (m·A = {m * a}: the end ranks send one direction only, "
          f"the middle ranks both)")
    print(f"mean over the ranks: measured {sent:.0f}, formula 2(p-1)mA/p = {formula:.0f}")
    claims.check_gpipe_bytes_sent(sent, formula, per_rank, m * a)
    grads = sum(w.numel() for w in reference.params.values()) * 8      # the whole model's float64 gradients
    layers = len({name.split(".")[1] for name in reference.params if name.startswith("blocks.")})
    ring = 2 * (p - 1) / p
    dp, tp = ring * grads, ring * 4 * m * a * layers   # TP: 4 all-reduces of the batch's activation (m·A) per layer
    busiest = max(per_rank)                                      # a middle rank: both directions, 2m·A
    print(f"the same {p} ranks and model, split three ways: bytes each rank sends per step (all-reduces: ring model; "
          f"× PP: those bytes over a middle PP rank's, the busiest)")
    rows = [("PP, a middle stage", busiest, "measured", "to its 2 neighbours, point to point, once per micro-batch"),
            ("DP (model), a replica each", dp, "ring model, not run",
             f"to all {p}, one all-reduce of the gradients a step (overlaps backward)"),
            (f"TP (model), 1/{p} of every layer", tp, "ring model, not run",
             f"to all {p}, 4 all-reduces per layer, each awaited by the next operator")]
    for label, sends, source, how in rows:
        print(f"  {label:32s} {sends:>9,.0f}  {sends / busiest:5.1f}× PP  {source:19s}  {how}")
    print("PP measured; DP and TP from the ring formula for the same model")
    claims.check_pp_sends_least(busiest, dp, tp)
    h = reference.params["ln_f.weight"].numel()
    tokens = m * a // (8 * h)                                    # T tokens a step; L = layers, the whole model's
    side = "below" if tokens < 12 * layers * h else "at or above"
    print(f"PP sends less than DP while T < 12·L·h: here T = {tokens} tokens a step, L = {layers} layers, h = {h}: "
          f"T is {side} 12·L·h = {12 * layers * h:,}")


def show_latency(p: int, m: int, alpha: float = 0.01) -> None:
    """A latency α on every send, on the simulator's clock (F = 1, BW = 2): how much longer each schedule's step
    gets, in α, beside the formula and the bubble."""
    from minipar.pipeline import Costs
    extra = {name: (simulate(make_schedule(name, p, m), Costs(p2p=alpha)).makespan
                    - simulate(make_schedule(name, p, m)).makespan) / alpha for name in ("gpipe", "1f1b")}
    formula = {"gpipe": (2 * (p - 1), "2(p-1)"), "1f1b": (2 * (p - 1) * m / p + 2 * (p - 2), "2(p-1)·m/p + 2(p-2)")}
    print(f"p = {p}, m = {m}, F = 1, BW = 2, latency α on every send: the step grows by")
    for name, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
        value, text = formula[name]
        print(f"  {label:6s} {extra[name]:4.0f}α   (formula {text} = {value:.0f})")
    costs = Costs()
    print(f"for scale, the bubble: (p-1)(F+BW) = {(p - 1) * (costs.F + costs.of('BW')):.0f}")
    claims.check_latency_on_critical_path(extra, p, m)


def show_vs_one_device(reference, results: list, dtype) -> None:
    """The run held equal to one device (every parameter, every step's loss), its comparison and both losses printed."""
    from minipar.check import compare
    print(compare(reference, results, dtype=dtype).assert_ok())
    print("losses on the last rank:", [round(x, 4) for x in results[-1].losses], " one device:",
          [round(x, 4) for x in reference.losses])


def show_same_bubble(p: int, m: int) -> None:
    g, o = simulate(make_schedule("gpipe", p, m)), simulate(make_schedule("1f1b", p, m))
    print(f"bubble: GPipe {g.bubble_fraction:.1%}, 1F1B {o.bubble_fraction:.1%} (idle/total); "
          f"{g.bubble_ratio:.1%}, {o.bubble_ratio:.1%} (idle/ideal)")
    claims.check_1f1b_bubble_equals_gpipe(g, o)


def show_pipedream(runs: dict, p: int) -> None:
    """{name: (recipe, per-rank runs, the rule's one-device result)}: each against its rule and against
    synchronous training, and the weight versions each rank held at once."""
    from minipar.check import compare, train_reference
    results = {}
    for name, (recipe, rs, rule) in runs.items():
        results[name] = compare(rule, rs).assert_ok(), compare(train_reference(recipe), rs)
        print(f"{name:5s} vs its rule: max |Δ| {results[name][0].max_abs_diff:.1e};  vs synchronous training: "
              f"max |Δ| {results[name][1].max_abs_diff:.1e};  weight versions held at once, per rank: "
              f"{[r.most_versions for r in rs]}")
    claims.check_pipedream_weight_versions_when_pipe(results, runs["2BW"][1], p, runs["async"][1])


def show_weight_versions(asynchronous: list, two_bw: list, p: int) -> None:
    from .figures import draw_weight_versions
    draw_weight_versions({"asynchronous PipeDream with weight stashing: 8 inputs, a new version after every backward": asynchronous,
                          "PipeDream-2BW: 4 batches of m = 4, a new version per batch, batch t uses version t-1": two_bw}, p)
    plt.show()
    used = {name: [{(k, j): v for k, _, j, v in r.versions_used} for r in rs]
            for name, rs in (("async", asynchronous), ("2bw", two_bw))}
    for r in range(p):
        print(f"stage {r}: async forward versions {[used['async'][r][('F', j)] for j in range(8)]};  "
              f"2BW forward versions {[used['2bw'][r][('F', j)] for j in range(16)]}")
    claims.check_async_weight_versions(used, p)


def show_layout(cut: list, p: int) -> None:
    from minipar.pipeline import stages
    for r in range(p):
        mine = stages.assign(cut, p, r)
        layers = sorted(int(n.split(".")[1]) for s in mine.values() for n in s.reference_params() if n.endswith("weight"))
        print(f"rank {r}: stages {sorted(mine)} -> layers {layers}")
    claims.check_interleaved_1f1b_v_chunks_per(cut, p)


def show_interleaved(p: int, m: int, chunks=(1, 2, 4)) -> dict:
    """Interleaved 1F1B simulated at each v: both bubble conventions, and the activations in flight."""
    inter = {v: simulate(make_schedule("interleaved", p, m, v)) for v in chunks}
    print(f"p={p}, m={m}:  v   idle/ideal (Megatron)      idle/total (this chapter)")
    for v, sim in inter.items():
        print(f"             {v}   {sim.bubble_ratio:6.1%} (= v=1 / {inter[1].bubble_ratio / sim.bubble_ratio:.2f})   "
              f"{sim.bubble_fraction:6.1%} (= v=1 / {inter[1].bubble_fraction / sim.bubble_fraction:.2f})")
    print("\nactivations held at the peak, v = 2 against 1F1B (v = 1), per rank:")
    print("rank  chunks (v=2)  stages' worth  1F1B stages  x 1F1B")
    for r in range(p):
        two, one = inter[2].peak_activations[r], inter[1].peak_activations[r]
        print(f"{r:4d}  {inter[2].peak_in_flight[r]:12d}  {two:13g}  {one:11g}  {two / one:6g}")
    claims.check_interleaved_bubble_formula(p, m, inter)
    claims.check_interleaving_falls_short_of_v(inter)
    claims.check_interleaved_peak_in_flight(inter)
    return inter


def show_interleaved_bytes(runs: dict, p: int, m: int, a: int, steps: int, reference, dtype) -> dict:
    """The interleaved run held equal to one device (``reference``, the 8-block model's), then {schedule: mean
    bytes a rank sent per step} of 1F1B and interleaved v = 2 (each rank's printed), beside 2(pv-1)·m·A/p."""
    from minipar.check import compare
    compare(reference, runs["interleaved"], dtype=dtype).assert_ok()
    per_rank = {name: [r.bytes_sent // steps for r in runs[name]] for name in ("1f1b", "interleaved")}
    sent = {name: sum(b) / p for name, b in per_rank.items()}
    for name, v in (("1f1b", 1), ("interleaved", 2)):
        print(f"{name:11s} v={v}: bytes sent per step, rank 0..{p - 1}: {per_rank[name]}; mean {sent[name]:.0f}, "
              f"formula 2(pv-1)mA/p = {2 * (p * v - 1) * m * a / p:.0f}")
    claims.check_interleaved_bytes_sent(sent, p, m, a, per_rank)
    return sent


def show_beside(beside: dict, m: int) -> None:
    for b in beside.values():
        print(b, "\n")
    claims.check_same_schedules_pytorch_torch_distributed(beside)
    claims.check_last_stage_ran_m_forwards_m(beside, beside["1f1b"].runs[-1], m)


def show_link(alpha: float, beta: float, pingpong: dict) -> None:
    """The ping-pong's fit: α always; β only where the largest size's transfer term S/β is at least α (else
    the fit's β is lost in the scatter of α, and the sizes cannot resolve it)."""
    largest = max(pingpong)
    beta_text = f", β ≈ {beta / 1e9:.1f} GB/s" if largest / beta >= alpha else ""
    print(f"one message here: α = {alpha * 1e6:.0f} µs{beta_text} "
          f"(ping-pong, {len(pingpong)} sizes up to {largest // 1024} KiB)")


def show_idle_breakdown(why, unpaced: dict, p: int) -> None:
    """The term-by-term replay of one traced 1F1B run (:func:`.timing.idle_breakdown`), printed and drawn."""
    from .timing import draw_terms
    print(why)
    draw_terms(why.terms, p)
    plt.show()
    i = why.idle
    print(f"The ladder replays the traced 1F1B run of the table above: {i['measured']:.0%} idle against the formula's "
          f"{i['formula']:.0%} (a rerun moves the measured value by many points).\n{why.steps()}")
    print(ladder_reading(i))
    claims.check_each_term_adds_idle(i, why)
    claims.check_ladder_is_the_tables_run(i, unpaced)


def show_explorer() -> None:
    """The sliders of :func:`.figures.schedule_explorer`, displayed; their function checked through the simulator
    alone (a valid combination simulated, an invalid one's ValueError shown, not raised)."""
    from IPython.display import display
    from .figures import schedule_explorer, schedule_or_error
    display(schedule_explorer())
    claims.check_m_p_error_shown_not_raised(schedule_or_error)


def show_1f1b_phases(p: int, m: int) -> None:
    """Rank 0's 1F1B list cut into warm-up (p-1 forwards), steady state and cool-down; then the bubble beside GPipe's."""
    acts = make_schedule("1f1b", p, m).actions[0]
    warm, steady = p - 1, 2 * (m - (p - 1))
    for label, part in (("warm-up", acts[:warm]), ("steady", acts[warm:warm + steady]), ("cool-down", acts[warm + steady:])):
        print(f"rank 0 {label:9s}:", " ".join(map(str, part)))
    show_same_bubble(p, m)

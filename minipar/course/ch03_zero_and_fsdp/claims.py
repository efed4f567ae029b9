"""Chapter 03's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import torch

from minipar.check import compare, train_reference
from minipar.observe.busy import run_disturbed
from minipar.observe.paced_compute import verdict
from minipar.data.zero_memory import GB
from minipar.data.zero_memory import model_state_bytes_formula


def check_papers_numbers(totals) -> None:
    """Where the memory of training goes: the paper's numbers"""
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def check_la_lb_lc_example_live(runs) -> None:
    """The La/Lb/Lc example, live on 3 ranks (the Hugging Face guide)"""
    assert [[name for layer in run["held"].values() for name, _ in layer] for run in runs] == \
        [["a0", "b0", "c0"], ["a1", "b1", "c1"], ["a2", "b2", "c2"]]


def check_each_layer_gathered_freed_scattered(step1, layer) -> None:
    """The La/Lb/Lc example, live on 3 ranks (the Hugging Face guide)"""
    assert [k for k, l in step1 if l == layer] == ["all-gather", "free", "all-gather", "reduce-scatter", "free"]


def check_prefetch_buys_hidden_gathers_with_memory(extra) -> None:
    """The La/Lb/Lc example, live on 3 ranks (the Hugging Face guide): prefetch buys its hidden gathers with
    memory: the next unit is gathered while this one computes"""
    assert extra > 0


def check_all_four_stages_measured(ratio) -> None:
    """All four stages, measured"""
    assert abs(ratio - 1.5) < 1e-9


def check_trains_like_one_device(reference, wire_runs, ring1, ring3, gloo1, gloo3, gloo2) -> None:
    """The communication trade-off: trains like one device; on gloo's collectives ZeRO-1/2 send 1.5× DDP's bytes
    and ZeRO-3 2× (its reduce-scatter is an all-reduce)"""
    assert all(compare(reference, [r[(c, 3)] for r in wire_runs]).matches for c in ("ring", "gloo"))   # trains like one device
    assert abs(ring1 - 1.0) < 0.03 and abs(ring3 - 1.5) < 0.03      # the paper's figures, on the wire
    assert abs(gloo1 - 1.5) < 0.08 and abs(gloo3 - 2.0) < 0.08      # gloo's reduce-scatter = an all-reduce
    assert abs(gloo2 - 1.5) < 0.08                                  # ZeRO-2: ZeRO-1's collectives, unit by unit


def check_zero2_reduce_scatters_every_micro_batch(logged_ratio, m, root_share, wire_runs, recipe) -> None:
    """§4: accumulating m micro-batches, ZeRO-1 still sends DDP's bytes a step. ZeRO-2 reduce-scatters every
    block's unit after each micro-batch and the root unit (whose gradients accumulate in place) once, then
    all-gathers once: (m·(1 − r) + r + 1)/2 × DDP's (ring model; r = the root's share of Ψ), near (m + 1)/2."""
    want = (m * (1 - root_share) + root_share + 1) / 2
    assert abs(logged_ratio[1] - 1) < 1e-9 and abs(logged_ratio[2] - want) < 1e-9, (logged_ratio, want)
    reference = train_reference(recipe)    # both train like one device; 4 partial sums: FP32 rounding, 1e-4
    assert all(compare(reference, [r[("accum", s)] for r in wire_runs], atol=1e-4, rtol=1e-4).matches for s in (1, 2))


def check_fsdp_modes_bytes_and_peaks(fsdp_modes, kept, zero2, full, hybrid, posted, between=None) -> None:
    """FSDP's modes, run as the ZeRO variants they are: SHARD_GRAD_OP (``kept``) holds FULL_SHARD's shards
    between steps, fewer than ZeRO-2 (``zero2``, parameters whole), and sends ZeRO-2's bytes; a node's shard:
    Ψ/2, not Ψ/4; each mode's bytes between steps equal its printed formula (``between``: {mode: bytes})"""
    assert all(m["matches"] for m in fsdp_modes.values())
    assert between is None or all(fsdp_modes[name]["between"] == b for name, b in between.items()), between
    assert kept["bytes"] == zero2["bytes"] == 2 / 3 * full["bytes"] and kept["calls"] == 2 / 3 * full["calls"]
    assert kept["between"] == full["between"] < zero2["between"] and kept["peak"] > full["peak"]
    assert hybrid["between"] == 2 * full["between"]                          # a node's shard: Ψ/2, not Ψ/4
    assert posted["bytes"] == full["bytes"] and posted["between"] == full["between"]


def check_same_training_bit_for_bit(off, plain, P, small) -> None:
    """Offload: the optimizer on the CPU (ZeRO-Offload), an FP32 run: the device keeps 4Ψ + 4Ψ/N, the host a
    separate FP32 master and the moments, 12Ψ/N; same training, bit for bit"""
    assert off["device"]["optimizer"] == 0 and plain["device"]["optimizer"] == 8 * P // 2
    assert all(run["device"]["params"] == 4 * P and run["device"]["grads"] == 4 * P // 2 for run in (off, plain))
    assert off["host"] == 12 * P // 2 and off["to_host"] == off["to_device"] == small.steps * 4 * P // 2
    assert all(torch.equal(off["params"][k], plain["params"][k]) for k in plain["params"])   # same training, bit for bit


def check_memory_centric_tiling_one_layer(outputs, peaks, grad_gaps) -> None:
    """Memory-centric tiling: one layer too large for the device; the same output and, through the
    checkpointed tiles' re-fetch in backward, the same gradients (float32 summation order)"""
    assert all(torch.equal(outputs[t], outputs[1]) for t in peaks)
    assert all(gap <= 1e-6 for gap in grad_gaps.values())
    assert peaks[16] <= 2 * peaks[1] / 16


def check_zero3_1b_params_on_8_gpus() -> None:
    """A calculator: the first view: 16 bytes × 1e9 / 8"""
    assert round(model_state_bytes_formula(1e9, 8, 3, "mixed")["total"] / GB, 1) == 2.0


def check_prefetch_saves_time_paced(m) -> None:
    """Prefetch, its time (chapter 03 §5): paced, ZeRO-3 with prefetch is never slower than without outside the
    spread (no prefetch's median below prefetch's [min – max], or prefetch's median above no prefetch's), unless
    other load took the cores (:func:`minipar.observe.busy.run_disturbed`), and both equal one device. Faster
    outside the spread is what a quiet run usually shows; a tie (about one quiet run in fifteen here, a slower
    spell of the machine: 1.7 ms of a 334 ms step) is stated as one by :func:`.paced.verdict_line`."""
    assert all(c.matches for c in m["matches"].values())
    if not run_disturbed(m):
        assert verdict(m["seconds"]["no prefetch"], m["seconds"]["prefetch"]) == "tie", m["seconds"]


def check_paced_verdict_follows_the_run(m, text) -> None:
    """Prefetch, its time (chapter 03 §5 and the Summary): the paced run's last line states the saving only
    when the run was timed on a quiet machine (not disturbed), and otherwise plainly that nothing was timed,
    with no saving stated"""
    body, last = text.rsplit("\n", 1)
    if run_disturbed(m):
        assert last.startswith("not timed: the machine was too busy") and "saves" not in body and "saved" not in text, text
    else:
        tie = verdict(m["seconds"]["prefetch"], m["seconds"]["no prefetch"]) == "tie"
        assert last.startswith("timed on a quiet machine: " + ("a tie" if tie else "prefetch saved")), text
        assert "not timed" not in text, text


def check_break_even_below_the_models_tokens(break_even, tokens) -> None:
    """Prefetch: the break-even on a DGX-A100 node is several hundred tokens per GPU, and the GPT-2-sized
    model's 4,096 are above it (so its gathers can hide)"""
    assert 500 < break_even < 1500 and tokens > break_even

"""Chapter 03 in the tour: ZeRO-1/2/3 on 4 ranks — on minipar's send/recv rings and on gloo's own
collectives — and PyTorch's FSDP2 (``fully_shard``), Adam on the tiny GPT.

Each row trains the recipe with one stage and checks it against single-device Adam (default FP32 tolerance of
:mod:`minipar.check`). Bytes per rank per step (mean over ranks and steps): the communication log's model,
what the sockets carried (:mod:`minipar.wire`) and :func:`minipar.data.zero_memory.bytes_sent_per_step`
(2bΨ(N-1)/N for stages 1-2, 3bΨ(N-1)/N for stage 3, Ψ padded per unit). The ``ring`` rows run the
reduce-scatters and all-gathers on :func:`minipar.comm.ring_reduce_scatter` / ``ring_all_gather``: the paper's
1x DDP and 1.5x DDP are observed. The ``gloo`` rows use torch.distributed's collectives: gloo's reduce-scatter
all-reduces the whole buffer, so the wire carries 1.5x DDP (stages 1-2) and 2.0x (stage 3) — observed, and
said in the note beside the ratio to DDP's observed bytes (measured in the same launch). Peak: live bytes
per rank (model states at the start of a step + the peak of what it allocated, gathered parameters
included); the note gives the model-state bytes next to the ZeRO paper's formula.

The FSDP row runs PyTorch's own ``torch.distributed.fsdp.fully_shard`` (FSDP2, per-parameter shards) on
the same units: its collectives bypass minipar's log (model "-"), so only the wire sees them — one step's
bytes = the observed bytes of a 3-step run minus those of a 2-step run (setup and final gathers cancel).
"""
from __future__ import annotations

import functools
import statistics

from minipar import comm
from minipar.check import compare, gpt_recipe, train_reference
from minipar.data import ddp, fsdp, zero, zero_memory
from minipar.data.zero_measure import measured_train
from minipar.launcher import launch
from minipar.course.tour import WORLD_SIZE, TourRow
from minipar.course.ch03_zero_and_fsdp.muon_rows import MUON_ROWS
from minipar.course.ch03_zero_and_fsdp.zeropp_row import zeropp_row

__all__ = ["STRATEGIES", "measure_all"]

STAGES = (1, 2, 3)
NAMES = {1: "ZeRO-1 (optimizer states sharded)", 2: "ZeRO-2 (+ gradients, reduce-scatter)",
         3: "ZeRO-3 (+ parameters, gather/free, prefetch)"}


def _recipe():
    return gpt_recipe(steps=3, batch_size=8, seq_len=16, optimizer="adam")


def _all_on_rank(rank, world_size, recipe):
    out = {}
    for c in ("ring", "gloo"):              # minipar's send/recv rings: the one switch, else gloo's collectives
        with comm.ring_algorithms(enabled=c == "ring"):
            out.update({(c, s): measured_train(rank, world_size, recipe, stage=s) for s in STAGES})
    log = comm.CommLog()
    result = ddp.parallel_train(rank, world_size, recipe, step_log=log)
    out["ddp"] = (result, log.bytes_sent / recipe.steps,
                  None if log.observed_bytes_sent is None else log.observed_bytes_sent / recipe.steps)
    return out


@functools.lru_cache(maxsize=1)
def measure_all() -> dict:
    """Every stage with both kinds of collectives, and DDP, in one launch: {key: [per rank]}."""
    recipe = _recipe()
    for s in STAGES:
        zero.validate(recipe, world_size=WORLD_SIZE, stage=s)
    per_rank = launch(_all_on_rank, WORLD_SIZE, recipe, quiet=True)
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


def _row(stage: int, collectives: str) -> TourRow:
    recipe, runs = _recipe(), measure_all()
    results = runs[(collectives, stage)]
    c = compare(train_reference(recipe), results)
    sent = statistics.mean(b for r in results for b in r.bytes_sent)
    seen = [b for r in results for b in r.bytes_observed]
    observed = None if None in seen else statistics.mean(seen)
    ddp_observed = [o for _, _, o in runs["ddp"]]
    psi = results[0].padded_numel
    formula = zero_memory.bytes_sent_per_step(psi, WORLD_SIZE, stage, "fp32")
    states = max(sum(r.memory[k] for k in ("params", "grads", "optimizer")) for r in results)
    want = zero_memory.model_state_bytes_formula(psi, WORLD_SIZE, stage, "fp32")["total"]
    paper = "1.5x" if stage == 3 else "1x"
    if observed is not None and None not in ddp_observed:
        ratio = observed / statistics.mean(ddp_observed)
        wire = f"observed {ratio:.2f}x DDP's observed bytes (paper: {paper})"
    else:
        wire = "not observed"
    if collectives == "gloo":
        wire += ("; gloo has no reduce-scatter: it all-reduces the whole buffer (2x the ring's bytes), "
                 "so the wire carries more than the formula; the ring row beside it sends the textbook bytes")
    note = (f"{wire}; model states {states} B/rank, formula {want:.0f} B (Ψ={results[0].numel}, "
            f"padded {psi})")
    return TourRow(f"{NAMES[stage]}, {collectives} collectives", WORLD_SIZE, c.matches, c.max_abs_diff, sent,
                   formula, max(r.memory["peak"] for r in results), note, bytes_observed_per_rank=observed,
                   calls_per_rank=None)


def _fsdp2_on_rank(rank, world_size, recipe):
    observed = []
    for steps in (recipe.steps - 1, recipe.steps):
        with comm.recording() as log:
            result = fsdp.torch_fsdp2_train(rank, world_size, recipe, steps=steps)
        observed.append(log.observed_bytes_sent)
    return result, observed, log.bytes_sent


def _torch_fsdp2() -> TourRow:
    recipe = _recipe()
    fsdp.validate(recipe, world_size=WORLD_SIZE)
    out = launch(_fsdp2_on_rank, WORLD_SIZE, recipe, quiet=True)
    c = compare(train_reference(recipe), [r for r, _, _ in out])
    seen = [o for _, o, _ in out]
    observed = None if any(None in o for o in seen) else statistics.mean(b - a for a, b in seen)
    psi = sum(p.numel() for p in recipe.model().parameters())
    per_param = sum(-(-p.shape[0] // WORLD_SIZE) * WORLD_SIZE * p[0].numel() if p.dim() else WORLD_SIZE
                    for p in recipe.model().parameters())             # FSDP2 pads each parameter's dim 0
    formula = zero_memory.bytes_sent_per_step(per_param, WORLD_SIZE, 3, "fp32")
    ratio = "" if observed is None else f" ({observed / formula:.2f}x)"
    note = (f"PyTorch's fully_shard (FSDP2) on the same units; it calls torch.distributed directly, so "
            f"minipar's log sees nothing and only the wire counts it: one step = observed(3 steps) - "
            f"observed(2 steps){ratio}; gloo's reduce-scatter all-reduces (2x), as in the gloo ZeRO-3 row; a "
            f"little less than that row: FSDP2 by default does not free the root unit after forward, so it is not "
            f"gathered again for backward; Ψ={psi}, {per_param} with each parameter padded on dim 0")
    return TourRow("FSDP2 (torch.distributed.fsdp.fully_shard)", WORLD_SIZE, c.matches, c.max_abs_diff,
                   None, formula, None, note, bytes_observed_per_rank=observed)


def _hsdp() -> TourRow:
    """HSDP on 4 ranks declared as 2 nodes of 2: ZeRO-3 inside each node, the gradient shards
    all-reduced across; equal to one device; the bytes its sends carried across the node boundary beside the
    formula and beside flat FSDP's (ZeRO-3 over all 4), run the same way."""
    from minipar.data import hsdp
    recipe = _recipe()
    reference = train_reference(recipe)
    runs = {mode: hsdp.run(recipe, world_size=WORLD_SIZE, per_node=2, mode=mode) for mode in ("hsdp", "fsdp")}
    c = compare(reference, runs["hsdp"])
    S = sum(p.numel() for p in recipe.model().parameters()) * 4
    cross = {m: statistics.mean(sum(r.cross_node[i] for r in rs) for i in range(recipe.steps)) for m, rs in runs.items()}
    want = {m: hsdp.CROSS_NODE_FORMULAS[m](S, WORLD_SIZE, 2) for m in runs}
    sent = statistics.mean(statistics.mean(r.sent) for r in runs["hsdp"])
    g, claimed, padded = 2, set(), 0                      # Ψ with each unit padded to the node's 2 shards
    for unit in zero.block_units(recipe.model()):
        mine = [p for p in unit.parameters() if p not in claimed and p.requires_grad]
        claimed.update(mine)
        padded += -(-sum(p.numel() for p in mine) // g) * g
    # per rank: ZeRO-3 inside the node (2 all-gathers + 1 reduce-scatter over g) + the shard's all-reduce across
    formula = zero_memory.bytes_sent_per_step(padded, g, 3, "fp32") + 2 * (2 - 1) / 2 * padded / g * 4
    note = (f"2 nodes × 2 (declared): bytes across the node boundary per step, all ranks: HSDP "
            f"{cross['hsdp']:,.0f} (formula 2(n−1)·S = {want['hsdp']:,.0f}) vs flat FSDP {cross['fsdp']:,.0f} "
            f"(n·3(N−1)/N·S = {want['fsdp']:,.0f}), ×{cross['fsdp'] / cross['hsdp']:.2f} less; parameters held "
            f"per rank {runs['hsdp'][0].param_bytes:,} B (Ψ/2) vs {runs['fsdp'][0].param_bytes:,} B (Ψ/4); bytes "
            f"counted from each send's destination on minipar's rings")
    seen = [b for r in runs["hsdp"] for b in r.observed]
    observed = None if None in seen else statistics.mean(seen)
    return TourRow("HSDP (shard in node, replicate across)", WORLD_SIZE, c.matches and compare(reference, runs["fsdp"]).matches,
                   c.max_abs_diff, sent, formula, None, note, bytes_observed_per_rank=observed)


def _async_reduce() -> TourRow:
    """ZeRO-3 with its reduce-scatters posted asynchronously (PyTorch FSDP's way): equal to one device,
    the bytes of ZeRO-3, 3bΨ(N-1)/N per rank per step (Ψ padded per unit)."""
    from .modes import run_modes
    name = "FULL_SHARD, async reduce-scatter"
    m = run_modes(WORLD_SIZE, (name,))[name]
    claimed, padded = set(), 0                         # Ψ with each unit padded to N shards, as ZeRO claims them
    for unit in zero.block_units(_recipe().model()):
        mine = [p for p in unit.parameters() if p not in claimed and p.requires_grad]
        claimed.update(mine)
        padded += -(-sum(p.numel() for p in mine) // WORLD_SIZE) * WORLD_SIZE
    note = ("each unit's reduce-scatter posted when its backward ends and taken before the optimizer step, so it "
            "can run under the next unit's backward (what it buys is time, not bytes or memory); compared with one "
            f"device; model states between steps {m['between']:,} B, peak {m['peak']:,} B per rank; on gloo's "
            f"collectives (minipar's rings block, which would undo the posting): gloo's reduce-scatter all-reduces the "
            f"whole buffer, so the wire carries (2 all-gathers + an all-reduce's 2)/3 = 1.33x the formula")
    return TourRow("ZeRO-3 async reduce-scatter", WORLD_SIZE, m["matches"], m["max_abs_diff"], m["bytes"],
                   zero_memory.bytes_sent_per_step(padded, WORLD_SIZE, 3, "fp32"), m["peak"], note,
                   bytes_observed_per_rank=m["observed"], calls_per_rank=m["calls"])


STRATEGIES = [
    *[(f"ZeRO-{s} ring", functools.partial(_row, s, "ring")) for s in STAGES],
    *[(f"ZeRO-{s} gloo", functools.partial(_row, s, "gloo")) for s in STAGES],
    ("FSDP2 (torch fully_shard)", _torch_fsdp2),
    ("HSDP (2 nodes)", _hsdp),
    ("ZeRO++ (2 nodes)", zeropp_row),
    ("ZeRO-3 async reduce-scatter", _async_reduce),
    *MUON_ROWS,
]

"""Chapter 03's paced run: ZeRO-3 with and without prefetch, each block's compute held to a slot sized from
its measured compute (:mod:`minipar.observe.paced_compute`), so that what prefetch saves shows on the wall clock.

One launch on N ranks trains the same GPT twice side by side with ZeRO-3 (one unit per block and the root,
:class:`minipar.data.zero.ZeRO`), ``prefetch=True`` and ``False``. With prefetch the next unit's all-gather
is issued when a unit starts and travels under its slot; without, each gather is issued and waited for where
its unit starts, outside any slot. Both wait for each reduce-scatter where it is issued (ZeRO's blocking
default), as the traced runs of :mod:`.timing` do, so the two differ in the gathers only and the paced and the
traced runs are the same program. One untimed step each comes first: it records the units' order (nothing
is prefetched in it) and the blocks' compute, the ranks computing together, from which the slots are sized
(:func:`minipar.observe.paced_compute.size_slots`: twice its 90th percentile, at least ``FORWARD_S`` /
``BACKWARD_S``, at most ``CEILING_S``). Rounds then alternate the two configurations
(:func:`minipar.observe.paced_compute.alternating_steps`: each step after a barrier, on its slowest rank).
Both are compared with one device (SGD, same batches: equal to float summation order): rank 0's gathered
parameters, and every other rank's through a hash of its gathered parameters' bytes, which must be rank 0's (sending
each rank's whole model back was a tenth of the run's time).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import statistics

import torch
import torch.distributed as dist

from minipar import comm
from minipar.check import compare, gpt_recipe, train_reference
from minipar.data import zero
from minipar.launcher import launch
from minipar.loop import shard_batch
from minipar.observe.busy import OtherWork, run_disturbed, run_too_busy
from minipar.observe.paced_compute import alternating_steps, median_wake, pace, size_slots, spread, verdict
from minipar.recipe import RunResult

__all__ = ["MODEL", "zero3", "paced_rank", "measure", "table", "regime", "verdict_line", "compute_note"]

MODEL = dict(n_layer=4, n_embd=320, n_head=4, vocab_size=256, block_size=16)   # a block: 4.9 MB of parameters
FORWARD_S, BACKWARD_S = 0.008, 0.016           # the narrowest slots: measured compute widens them (size_slots)
CEILING_S = 0.036                              # the widest: 8 paced steps stay under 2.5 s of slots
ROUNDS = 3      # timed steps of each configuration: 3 keep prefetch's saving outside the spread (5 did too, for
                # 4 steps more of the chapter's slowest cell; the spread is not what the table shows)
CONFIGS = {"prefetch": True, "no prefetch": False}

VERDICTS = {"apart": "ranges apart: every step with prefetch faster than every step with no prefetch",
            "median outside": ("the ranges overlap, a median lies outside the other's [min – max]: a typical step "
                               "saves, not every step"),
            "tie": "a tie: each median inside the other's [min – max]"}


def zero3(model, recipe, prefetch: bool):
    """ZeRO-3 as :func:`minipar.data.zero.parallel_train` builds it for the traced runs: one unit per block and
    the root, reduce-scatters blocking (no ``async_reduce``); only ``prefetch`` varies."""
    return zero.ZeRO(model, recipe.optimizer, 3, prefetch=prefetch)


def paced_rank(rank, world_size, recipe, forward_s, backward_s):
    """{"seconds": {config: [s per round]}, "results": {config: RunResult} (the parameters on rank 0 only),
    "digests": {config: hash of the gathered parameters}, "overruns", "slots", "slot_s", "compute_s", "late_s"}:
    the recipe's first batch untimed (it records the units' order and the blocks' compute, from
    which ``size_slots`` sizes the slots, ``forward_s`` and ``backward_s`` the narrowest), then one round per
    later batch."""
    torch.set_num_threads(1)
    state, pacers = {}, []
    for name, prefetch in CONFIGS.items():
        model = recipe.model()
        sharded = zero3(model, recipe, prefetch)
        pacers.append(pace(model.blocks, forward_s, backward_s))
        state[name] = (model, sharded, [])

    def step(name):
        model, sharded, losses = state[name]
        x, y = shard_batch(recipe.batches[len(losses)], rank, world_size)
        sharded.zero_grad()
        loss = recipe.loss(model, x, y)
        loss.backward()
        sharded.step()
        losses.append(loss.item())
    for name in CONFIGS:
        step(name)                                          # untimed: records the units' order and the compute
    compute_s = _median_compute(pacers)                     # (printed; size_slots clears it)
    slot_s = size_slots(pacers, (forward_s, backward_s), ceiling=CEILING_S)   # resets the slots' counts too
    seconds = alternating_steps({n: (lambda n=n: step(n)) for n in CONFIGS}, recipe.steps - 1)
    late_s = median_wake(pacers)                            # how late the timed steps' sleeps woke: other work?
    results, digests = {}, {}
    for n, (_, sharded, losses) in state.items():
        losses, full = _mean_over_ranks(losses), sharded.full_parameters()     # collectives: every rank takes part
        results[n], digests[n] = RunResult(losses, full if rank == 0 else {}), _digest(full)
    return {"seconds": seconds, "results": results, "digests": digests, "overruns": sum(p.overruns for p in pacers),
            "slots": sum(p.held for p in pacers), "slot_s": slot_s, "compute_s": compute_s, "late_s": late_s}


def _median_compute(pacers) -> tuple:
    """(forward s, backward s): the median compute of a block in the steps the ``pacers`` held, on the slowest
    rank (collective)."""
    took = torch.tensor([statistics.median(t for p in pacers for t in p.computed[kind])
                         for kind in ("forward", "backward")], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return tuple(took.tolist())


def _digest(params: dict) -> str:
    """SHA-256 of the parameters' bytes, in name order: equal on two ranks exactly when their parameters are (any
    dtype or device: the bytes are read as uint8 on the CPU)."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(params[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _on_every_rank(match, ranks: list, name: str):
    """Rank 0's comparison with one device, failed if another rank's gathered parameters differ from rank 0's."""
    differ = [i for i, r in enumerate(ranks) if r["digests"][name] != ranks[0]["digests"][name]]
    if not differ:
        return match
    return dataclasses.replace(match, matches=False,
                               problems=match.problems + [f"rank(s) {differ}: parameters differ from rank 0's"])


def _mean_over_ranks(losses: list) -> list:
    """Each step's loss averaged over the ranks (equal shards: the global batch's mean loss)."""
    t = torch.tensor(losses, dtype=torch.float64)
    comm.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def measure(world_size: int = 4, rounds: int = ROUNDS, forward_s: float = FORWARD_S,
            backward_s: float = BACKWARD_S) -> dict:
    """Launch :func:`paced_rank`; {"seconds": {config: [s]}, "matches": {config: Comparison with one device},
    "overruns", "slots" (how many were held, all ranks), "slot_s": the (forward, backward) slots the run held
    (``size_slots``, ``forward_s`` and ``backward_s`` the narrowest), "compute_s": a block's median compute, "blocks",
    "block_bytes", "load" (1-minute load average when the runs ended), "late_s" (the median wake-up after a slot's
    end, the highest over the ranks: what decides whether other work disturbed the run)}."""
    recipe = gpt_recipe(steps=rounds + 1, batch_size=4, seq_len=16, optimizer="sgd", **MODEL)
    with OtherWork() as other:                  # other processes' CPU meanwhile: were the cores the run's?
        ranks = launch(paced_rank, world_size, recipe, forward_s, backward_s, quiet=True, timeout=120)
    reference = train_reference(recipe)
    matches = {n: _on_every_rank(compare(reference, [ranks[0]["results"][n]], atol=1e-5, rtol=1e-4), ranks, n)
               for n in ranks[0]["results"]}
    block = recipe.model().blocks[0]
    return {"seconds": ranks[0]["seconds"], "matches": matches, "overruns": sum(r["overruns"] for r in ranks),
            "load": os.getloadavg()[0], "late_s": ranks[0]["late_s"], "other_cores": other.cores,
            "slots": sum(r["slots"] for r in ranks), "slot_s": ranks[0]["slot_s"], "compute_s": ranks[0]["compute_s"],
            "blocks": MODEL["n_layer"], "ceiling_s": CEILING_S,
            "block_bytes": sum(p.numel() * p.element_size() for p in block.parameters())}


def table(m: dict) -> str:
    """The printed lines, the result first: the saving (or why the times are not compared), each configuration's
    step time, median [min – max], then how the steps were paced and why the saving is small."""
    f, b = m["slot_s"]
    busy = run_too_busy(m)
    lines = []
    if busy:                                            # a disturbed run states no saving: its times do not count
        lines.append(busy)
    else:
        with_p, without = (statistics.median(s) for s in m["seconds"].values())
        lines.append(f"prefetch saves {(without - with_p) * 1e3:.1f} ms a step ({1 - with_p / without:.0%}); "
                     + VERDICTS[verdict(*m["seconds"].values())])
    for name, s in m["seconds"].items():                # a disturbed run prints no times: none to compare
        lines.append(f"  ZeRO-3, {name:12}: step {'not timed' if busy else spread(s)}; "
                     f"{'matches' if m['matches'][name].matches else 'DOES NOT MATCH'} one device "
                     f"(max |Δ| {m['matches'][name].max_abs_diff:.0e})")
    lines.append(f"  paced: a GPT of {m['blocks']} blocks, h = {MODEL['n_embd']}, {MODEL['n_head']} heads, vocabulary "
                 f"{MODEL['vocab_size']}; each forward held to {f * 1e3:.0f} ms and backward to "
                 f"{b * 1e3:.0f} ms ({m['blocks'] * (f + b) * 1e3:.0f} ms of slots a step{_computes(m)}{_capped(m)}); a block's all-gather "
                 f"brings {m['block_bytes'] / 1e6:.1f} MB; slots that ran long: {m['overruns']} of {m['slots']}")
    if busy:
        return "\n".join(lines)
    slots = m["blocks"] * (f + b)
    share = 1 - slots / without
    lines.append(f"  without prefetch, {slots * 1e3:.0f} ms of the {without * 1e3:.0f} ms step is compute slots and "
                 f"{share:.0%} is gloo's collectives on the shared cores ({regime(share)}); prefetch hides "
                 f"gathers under compute, so it can save at most the {slots * 1e3:.0f} ms of slots")
    return "\n".join(lines)


def regime(collectives_share: float) -> str:
    """What bounds the step without prefetch, by the collectives' share of it: over 55 % communication, under 45 %
    compute, between the two about even (a 49 % step called "compute-bound" read as a contradiction)."""
    if collectives_share > 0.55:
        return "communication-bound"
    return "compute-bound" if collectives_share < 0.45 else "compute and collectives about even"


def _capped(m: dict) -> str:
    """'; the forward's slot is the longest allowed, 36 ms: twice its slow end was more' (or the backward's, or
    both) when ``size_slots`` clipped a slot at the run's ceiling (``m["ceiling_s"]``, :data:`CEILING_S`): why a
    forward's slot can come out no longer than a backward's; "" when neither was clipped."""
    ceiling = m.get("ceiling_s", CEILING_S)
    capped = [kind for kind, slot in zip(("forward", "backward"), m["slot_s"]) if slot >= ceiling - 1e-9]
    if not capped:
        return ""
    if len(capped) == 2:
        return f"; both slots are the longest allowed, {ceiling * 1e3:.0f} ms: twice each one's slow end was more"
    return f"; the {capped[0]}'s slot is the longest allowed, {ceiling * 1e3:.0f} ms: twice its slow end was more"


def _computes(m: dict) -> str:
    """', a block computes in a / b ms here' when the run measured it (what the slots were sized from)."""
    if "compute_s" not in m:
        return ""
    cf, cb = m["compute_s"]
    return f"; measured here, a block's forward takes {cf * 1e3:.1f} ms, its backward {cb * 1e3:.1f} ms"


def verdict_line(m: dict) -> str:
    """The run's last line: on a quiet machine, the saving it timed (or that it tied); on a busy one, that nothing was timed (the
    first line, :func:`minipar.observe.busy.too_busy`'s, says why), and what a quiet run shows instead (the bound
    from this run's slots). The rules for "quiet" are the chapter's fold, not this line."""
    f, b = m["slot_s"]
    slots_ms = m["blocks"] * (f + b) * 1e3
    if not run_disturbed(m):
        with_p, without = (statistics.median(s) for s in (m["seconds"]["prefetch"], m["seconds"]["no prefetch"]))
        if verdict(m["seconds"]["prefetch"], m["seconds"]["no prefetch"]) == "tie":
            return (f"timed on a quiet machine: a tie this time (the median step {abs(without - with_p) * 1e3:.1f} ms "
                    f"{'shorter' if with_p <= without else 'longer'} with prefetch, of {without * 1e3:.0f} ms, inside the "
                    "steps' spread): no saving shown; quiet runs here usually show one, so run the cell again")
        return (f"timed on a quiet machine: prefetch saved {(without - with_p) * 1e3:.1f} ms of a "
                f"{without * 1e3:.0f} ms step ({1 - with_p / without:.0%})")
    return ("not timed: the machine was too busy, so these steps show neither that prefetch saves time nor that it "
            "does not; on a quiet machine the steps with prefetch are usually shorter than without, beyond their spread, "
            f"by less than the {slots_ms:.0f} ms of slots a step")


def compute_note(m: dict) -> str:
    """Why the paced line's backward is not twice its forward, when it is not: the times are wall-clock ones on
    shared cores (none when the run measured no compute, or a backward at least 1.5 × the forward)."""
    if "compute_s" not in m or m["compute_s"][1] >= 1.5 * m["compute_s"][0]:
        return []
    return ["  (a backward does twice a forward's arithmetic, yet the two times are close: they are wall-clock "
            f"times of ranks sharing {os.cpu_count() or 1} cores with each other and gloo's threads, so they include "
            "waiting for a core, which does not scale with the arithmetic; the slots only need to cover them)"]

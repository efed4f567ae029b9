"""Chapter 02's paced run: DDP with a bucket per block against one bucket, each block's compute held to a
fixed slot (:mod:`minipar.observe.paced_compute`), so that what overlap saves shows on the wall clock.

One launch on N ranks trains the same GPT twice side by side, with DDP's buckets about one block's gradients
(``bucket_bytes`` = a block's parameter bytes: a bucket leaves as each block's backward ends and travels under
the next block's backward slot) and with one bucket holding every gradient (its all-reduce can start only
after the last gradient: nothing hides). The slots are sized from the compute the ranks measure together in
two untimed steps (:func:`minipar.observe.paced_compute.size_slots`: twice its 90th percentile, at least
``FORWARD_S`` / ``BACKWARD_S``), so a slower or busier machine gets wider slots, not overruns; if more than
5 % of the timed slots still ran long, the slots are widened again from the timed steps' compute and the
rounds timed once more. Rounds alternate the two configurations (:func:`minipar.observe.
paced_compute.alternating_steps`: each step after a barrier, on its slowest rank); one untimed step each
first. Both are compared with one device (SGD, same batches: equal to float summation order).
"""
from __future__ import annotations

import dataclasses
import os
import statistics

import torch
import torch.distributed as dist

from minipar import comm
from minipar.check import compare, gpt_recipe, train_reference
from minipar.data import ddp
from minipar.data.ddp_measure import watch_buckets
from minipar.launcher import launch
from minipar.loop import shard_batch
from minipar.observe.busy import DISTURBED_SHARE, OtherWork, run_too_busy
from minipar.observe.paced_compute import alternating_steps, median_wake, pace, size_slots, spread, verdict
from minipar.recipe import RunResult

__all__ = ["MODEL", "paced_rank", "measure", "table", "not_timed", "step_parts"]

MODEL = dict(n_layer=4, n_embd=320, n_head=4, vocab_size=256, block_size=16)   # about 5 MB of gradients a block
FORWARD_S, BACKWARD_S = 0.010, 0.020           # the narrowest slots: measured compute widens them (size_slots)
CEILING_S = 0.080                              # the widest: 24 paced steps at most stay under 16 s

VERDICTS = {"apart": "ranges apart: every step with bucket per block faster than every step with one bucket",
            "median outside": "outside the spread: a median lies outside the other's [min – max]",
            "tie": "a tie: each median inside the other's [min – max]"}


def paced_rank(rank, world_size, recipe, forward_s, backward_s):
    """{"seconds": {config: [s per round]}, "exposed_s": {config: [s from the last gradient to the last bucket's
    completion, each timed step, the longest over the ranks]}, "allreduce_s": [s of the one bucket's all-reduce alone, 3 times],
    "results": {config: RunResult}, "buckets": {config: [bytes of each
    bucket, in launch order]},
    "overruns": slots that ran long, "slots": slots held, "late_s": the median of how late the timed steps' sleeps woke
    up (the highest over the ranks)}: the first batch untimed, then one round per later batch."""
    torch.set_num_threads(1)
    block_bytes = sum(p.numel() * p.element_size() for p in recipe.model().blocks[0].parameters())
    configs = {"bucket per block": block_bytes, "one bucket": 1 << 40}
    state, pacers = {}, []
    for name, size in configs.items():
        model = recipe.model()
        wrapped = ddp.DistributedDataParallel(model, bucket_bytes=size)
        pacers.append(pace(model.blocks, forward_s, backward_s))
        state[name] = (model, wrapped, recipe.optimizer(model.parameters()), [])

    events = {name: watch_buckets(state[name][1]) for name in configs}   # gradients ready, buckets launched, done
    exposed = {name: [] for name in configs}

    def step(name):
        model, wrapped, opt, losses = state[name]
        x, y = shard_batch(recipe.batches[len(losses)], rank, world_size)
        first = len(events[name])
        opt.zero_grad(set_to_none=True)
        loss = recipe.loss(wrapped, x, y)
        loss.backward()
        seen = events[name][first:]                         # this step's: last gradient -> last bucket done
        exposed[name].append(max(e[3] for e in seen if e[0] == "comm") - max(e[2] for e in seen if e[0] == "grad"))
        opt.step()
        losses.append(loss.item())
    for name in configs:
        step(name)                                          # warm-up, untimed (the first step's one-off costs)
    for p in pacers:
        p.computed = {"forward": [], "backward": []}
    for name in configs:
        step(name)                                          # untimed: the compute measured, the ranks together
    slot_s = size_slots(pacers, (forward_s, backward_s), ceiling=CEILING_S)   # sized from it; never under the floor
    rounds, first_try = (recipe.steps - 2) // 2, None
    for timed in exposed.values():
        timed.clear()                                       # only the timed steps count
    seconds = alternating_steps({n: (lambda n=n: step(n)) for n in configs}, rounds)
    counts = torch.tensor([sum(p.overruns for p in pacers), sum(p.held for p in pacers)], dtype=torch.float64)
    comm.all_reduce(counts)                                 # every rank takes the same decision
    if counts[0] > DISTURBED_SHARE * counts[1]:             # too many ran long: widen from what they took, once more
        first_try = {"overruns": int(counts[0]), "slots": int(counts[1]), "slot_s": slot_s}
        slot_s = size_slots(pacers, slot_s, ceiling=CEILING_S)
        for timed in exposed.values():
            timed.clear()
        seconds = alternating_steps({n: (lambda n=n: step(n)) for n in configs}, rounds)
    for name, timed in exposed.items():                    # each step's longest over the ranks
        worst = torch.tensor(timed, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        exposed[name] = worst.tolist()
    late_s = median_wake(pacers)                            # how late the timed steps' sleeps woke: other work?
    alone = state["one bucket"][1].reducer.buckets[0].buffer.clone()   # what one bucket has to hide, no compute
    allreduce_s = alternating_steps({"all-reduce": lambda: comm.all_reduce(alone)}, 3)["all-reduce"]
    results = {n: RunResult(_mean_over_ranks(losses), {k: p.detach().clone() for k, p in m.named_parameters()})
               for n, (m, _, _, losses) in state.items()}
    return {"seconds": seconds, "exposed_s": exposed, "allreduce_s": allreduce_s, "results": results, "overruns": sum(p.overruns for p in pacers),
            "slots": sum(p.held for p in pacers), "slot_s": slot_s, "first_try": first_try, "late_s": late_s,
            "buckets": {n: [b.buffer.numel() * b.buffer.element_size() for b in w.reducer.buckets]
                        for n, (_, w, *_) in state.items()}}


def _mean_over_ranks(losses: list) -> list:
    """Each step's loss averaged over the ranks (equal shards: the global batch's mean loss)."""
    t = torch.tensor(losses, dtype=torch.float64)
    comm.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def measure(world_size: int = 4, rounds: int = 5, forward_s: float = FORWARD_S,
            backward_s: float = BACKWARD_S) -> dict:
    """Launch :func:`paced_rank`; {"seconds": {config: [s]}, "exposed_s": {config: [s]}, "allreduce_s": [s], "matches": {config: Comparison with one device},
    "buckets", "overruns", "slots" (how many were held, all ranks), "slot_s": (forward_s, backward_s), "blocks",
    "grad_bytes", "load" (1-minute load average when the runs ended), "late_s" (the median wake-up after a slot's end:
    what decides whether other work disturbed the run, :func:`~minipar.observe.busy.disturbed`)}."""
    recipe = gpt_recipe(steps=2 + 2 * rounds, batch_size=4, seq_len=16, optimizer="sgd", **MODEL)
    with OtherWork() as other:                  # other processes' CPU meanwhile: were the cores the run's?
        ranks = launch(paced_rank, world_size, recipe, forward_s, backward_s, quiet=True, timeout=120)
    taken = len(ranks[0]["results"]["one bucket"].losses)      # 2 untimed + the rounds (twice if retried)
    reference = train_reference(dataclasses.replace(recipe, batches=recipe.batches[:taken]))
    matches = {n: compare(reference, [r["results"][n] for r in ranks], atol=1e-5, rtol=1e-4)
               for n in ranks[0]["results"]}
    return {"seconds": ranks[0]["seconds"], "exposed_s": ranks[0]["exposed_s"], "allreduce_s": ranks[0]["allreduce_s"], "matches": matches, "buckets": ranks[0]["buckets"],
            "load": os.getloadavg()[0], "late_s": ranks[0]["late_s"], "other_cores": other.cores,
            "overruns": sum(r["overruns"] for r in ranks), "slots": sum(r["slots"] for r in ranks),
            "slot_s": ranks[0]["slot_s"], "floor_s": (forward_s, backward_s), "first_try": ranks[0]["first_try"],
            "blocks": MODEL["n_layer"],
            "grad_bytes": sum(p.numel() * p.element_size() for p in recipe.model().parameters())}


def table(m: dict, verbose: bool = False) -> str:
    """The printed lines, the result first: the saving; then how long each step still waited for its all-reduces
    after its last gradient (timed inside the steps, median) and what share of the saving their difference is;
    then each configuration's step time, median [min – max], and its buckets (MB each, in launch order), and the
    verdict. ``verbose`` adds how it was measured (the compute floor, the slots, how many ran long, the all-reduce
    alone, as a scale) and the steps' parts (:func:`step_parts`). A run the cores disturbed (:func:`too_busy`) shows no step
    times and no saving, since they are not compared: its first lines (:func:`not_timed`) say so and what a quiet
    run shows, and it always ends with the measurement line and why."""
    f, b = m["slot_s"]
    busy = run_too_busy(m)
    lines = [] if not busy else not_timed(m)
    if not busy:
        per_block, one = (statistics.median(s) for s in m["seconds"].values())
        # in ms only: the slots are stretched on purpose, so a share of this step would say nothing of a GPU's
        lines.append(f"overlap saves {(one - per_block) * 1e3:.1f} ms a step, timed on a quiet machine")
        if "exposed_s" in m:                            # the all-reduce's wait after the last gradient, in the steps
            wait_block, wait_one = (statistics.median(s) for s in m["exposed_s"].values())
            lines.append(f"  after the last gradient, each step still waited for its all-reduces: one bucket "
                         f"{wait_one * 1e3:.1f} ms, bucket per block {wait_block * 1e3:.1f} ms; the difference, "
                         f"{(wait_one - wait_block) * 1e3:.1f} ms, is "
                         + _share_of_saving(wait_one - wait_block, one - per_block))
    for name, s in m["seconds"].items():
        sizes = " + ".join(f"{b / 1e6:.1f}" for b in m["buckets"][name])
        step = "step time not shown" if busy else f"step {spread(s)}"
        lines.append(f"  DDP, {name:17} {step}; all-reduces of {sizes} MB; "
                     f"{'matches' if m['matches'][name].matches else 'DOES NOT MATCH'} one device "
                     f"(max |Δ| {m['matches'][name].max_abs_diff:.0e})")
    if not busy:
        lines.append("  " + VERDICTS[verdict(*m["seconds"].values())])
    alone_text = (f"; the one bucket's all-reduce alone, no compute and the ranks started together: "
                  f"{spread(m['allreduce_s'])}" if "allreduce_s" in m else "")
    retried = m.get("first_try")
    retry_text = (f"; a first try ran long in {retried['overruns']} of {retried['slots']} slots (forward "
                  f"{retried['slot_s'][0] * 1e3:.0f} ms, backward {retried['slot_s'][1] * 1e3:.0f} ms), so the slots "
                  "were widened from what its compute took and the steps timed again") if retried else ""
    measured = (f"paced: {m['blocks']} blocks, slots sized from the compute measured in the untimed steps: forward "
                f"{f * 1e3:.0f} ms, backward {b * 1e3:.0f} ms, compute floor "
                f"(slots) {m['blocks'] * (f + b) * 1e3:.0f} ms ({m['overruns']} of {m['slots']} slots ran long){retry_text}; "
                f"{m['grad_bytes'] / 1e6:.1f} MB of gradients" + alone_text)
    if busy:                                            # a disturbed run states no saving: its times do not count
        return "\n".join(lines + [measured, "  " + busy])
    if not verbose:                                     # the result only; the apparatus on request
        return "\n".join(lines)
    return "\n".join(lines + [measured] + (step_parts(m) if "exposed_s" in m else []))


def _share_of_saving(waited_less: float, saving: float) -> str:
    """'83% of the saving', or, from 95 % on, 'about all of the saving': the wait is timed inside the steps, the
    saving between them, so their ratio can pass 100 % by a few points (a quiet run: 56.1 ms of a 55.1 ms saving)."""
    share = waited_less / saving
    return f"{share:.0%} of the saving" if share < 0.95 else "about all of the saving"


def not_timed(m: dict) -> list:
    """The first lines of a run the cores disturbed, in place of the saving: it was not timed, and why; that it
    is no evidence; what a quiet run shows (a bucket per block the faster step: the claim holds it whenever the
    run is timed) and where the chapter models the saving (Deeper D2)."""
    cores = os.cpu_count() or 1                         # as too_busy counts them
    woke = f"ranks woke a median {m['late_s'] * 1e3:.1f} ms late from their slots; " if m.get("late_s") is not None else ""
    if m.get("other_cores") is not None:
        woke = f"other processes used {m['other_cores']:.1f} cores; " + woke
    return [f"no result: the machine was busy ({woke}load average {m['load']:.1f} on {cores} cores; {m['overruns']} of "
            f"{m['slots']} slots ran long), so this run's step times are no evidence of what overlap saves",
            "  on a quiet machine the step with a bucket per block is the faster one: its buckets travel under the "
            "backward slots, the one bucket only after them; Deeper D2 models the saving on a GPU node"]


def step_parts(m: dict) -> list:
    """The median steps taken apart: the slots, the wait for the all-reduces after the last gradient (timed in
    the steps), and the rest (the unpaced embedding, head and loss, the optimizer step, the copies out of the
    buckets, the slowest rank); the saving is the difference in the wait plus the difference in the rest."""
    f, b = m["slot_s"]
    slots = m["blocks"] * (f + b)
    parts = []
    for name, s in m["seconds"].items():
        step, wait = statistics.median(s), statistics.median(m["exposed_s"][name])
        parts.append(f"  {name}: step {step * 1e3:.1f} ms = {slots * 1e3:.0f} slots + {wait * 1e3:.1f} waiting for "
                     f"the all-reduces after the last gradient + {(step - slots - wait) * 1e3:.1f} rest")
    return parts + ["  (rest: the unpaced embedding, head and loss, the optimizer step, the copies out of the "
                    "buckets, the slowest rank)"]

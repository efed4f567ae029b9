"""Chapter 13's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import torch


def check_hang_where_ranks_parted(left_running, error) -> None:
    """A hang, and the first call a rank never issued"""
    assert left_running == 0 and "never issued" in error.flight


def check_silent_mismatch_sums(sums, world_size) -> None:
    """Calls #3 and #4 paired a step with the next one: rank 2's step 4 and 5 into the others' 3 and 4"""
    if sums:
        assert sums == {"1": f"{world_size}", "2": f"{2 * world_size}",
                        "3": f"{3 * world_size + 1}", "4": f"{4 * world_size + 1}"}, sums


def check_desync_caught_before_hang(error) -> None:
    """A desync, caught before the hang"""
    assert "float32[4]" in str(error) and "float32[8]" in str(error)


def check_every_rank_reports_mismatch(reports) -> None:
    """A desync, caught before the hang"""
    assert all("Detected mismatch" in r.get("error", "") for r in reports)
    assert all(state == "scheduled" for r in reports for _, _, state in r["recorded"])
    ops = [op for op, _, _ in reports[0]["recorded"]]                 # each all-reduce after two all-gathers
    assert ops[:3] == ["gloo:all_gather", "gloo:all_gather", "gloo:all_reduce"]


def check_stragglers_which_rank_makes_others(slow, rows) -> None:
    """Stragglers: which rank makes the others wait, and what it costs: the fast rank waits inside the
    all-reduce for most of its wall step, longer than the straggler."""
    assert slow.rank == 1 and slow.compute > 2 * slow.others_compute
    fast = rows[1 - slow.rank]
    assert fast["comm"] > rows[slow.rank]["comm"] and fast["comm"] > 0.5 * fast["step"], rows


def check_microseconds_wire(step, step_fixed, as_run, slow, wall_step) -> None:
    """Stragglers: which rank makes the others wait, and what it costs: microseconds on the wire"""
    assert step > step_fixed and as_run.idle(1 - slow.rank) > as_run.idle(slow.rank)
    assert max(as_run.exposed(r) for r in range(2)) < 0.01 * sum(as_run.step_gaps())    # microseconds on the wire
    assert (step - step_fixed) / step > slow.cost / wall_step       # a larger share replayed than measured


def check_few_epsilons(noise) -> None:
    """Silent wrong gradients: the equality harness as a debugger: a few epsilons"""
    assert noise[torch.float32] > 1e6 * noise[torch.float64]
    assert all(d < 100 * torch.finfo(dtype).eps for dtype, d in noise.items())        # a few epsilons


def check_controls_under_tolerance(controls: dict, tolerance: float) -> None:
    """Silent wrong gradients: a correct TP 2 and ring-attention run stay a few epsilons from one device, under
    the tolerance measured on DDP (no false positive)"""
    assert all(d < 100 * torch.finfo(torch.float64).eps and d < tolerance for d in controls.values())


def check_silent_wrong_gradients_equality_harness(tp, ddp, ring) -> None:
    """Silent wrong gradients: the equality harness as a debugger"""
    assert tp.boundary == "ln_f.bias" and tp.right == ["head.weight"]
    assert ddp.wrong == ["blocks.1.mlp.proj.weight", "blocks.1.mlp.proj.bias", "ln_f.weight", "ln_f.bias"]
    assert ring.boundary == "blocks.1.attn.qkv.bias" and "blocks.1.attn.proj.weight" in ring.right


def check_first_divergence_found(result, step: int) -> None:
    """Silent wrong gradients: the equality harness as a debugger"""
    assert result.first is not None and result.first.step == step and 1e-3 < result.first.size < 1e-1


def check_randomness_across_ranks(right, wrong, masks) -> None:
    """Randomness across ranks"""
    assert max(right.values()) == 0.0 and max(wrong.values()) > 0 and masks["wrong"] == 1.0
    # by Megatron's rule the split region's masks agree as independent ones do, within 3 standard deviations
    assert abs(masks["right"] - masks["independent"]) < 3 * masks["sd"], masks


def check_resume_restores_random_state(straight, resumed, restore) -> None:
    """Randomness across ranks"""
    assert (straight == resumed) == restore


def check_nan_first_operator_rank_that(born0, finite0, born1) -> None:
    """NaN: the first operator, and the rank, that produced it"""
    assert born0 is None and not finite0 and born1.op == "exp" and born1.rank == 1 and born1.largest_input > 11.09


def check_sum_orders(sums) -> None:
    """Equal to the last bit: one sum in several orders"""
    ulps = {order: u for order, (_, u) in sums.items()}
    assert ulps.pop("left to right (one device)") == 0 and all(u > 0 for u in ulps.values())
    assert len({value for value, _ in sums.values()}) == len(sums)          # every order a different float


def check_split_sums_no_further_from_exact(from_exact) -> None:
    """Equal to the last bit: the ranks' orders are no further from the correctly rounded sum than one device's;
    on this seed one device's order is the farthest of all"""
    one_device = from_exact["left to right (one device)"]
    assert all(from_exact[order] <= one_device for order in from_exact if "ranks" in order)
    assert all(from_exact[order] < one_device for order in from_exact if order != "left to right (one device)")


def check_first_differences(diffs) -> None:
    """Equal to the last bit: where each layout parts from one device"""
    assert diffs["pp 2, one micro-batch"].name is None
    for label, words in (("dp 2", "DP all-reduce"), ("micro-batches 2", "accumulation over micro-batches")):
        assert diffs[label].name == "backward head.weight.grad" and words in diffs[label].reduction
        assert "forward" not in diffs[label].first_in_phase
    assert diffs["tp 2"].name == "forward blocks.0.attn.proj" and "inner dimension" in diffs["tp 2"].reduction
    assert diffs["cp 2"].name == "forward blocks.0.attn.core" and "key-block merge" in diffs["cp 2"].reduction
    assert all(d.ulps_max >= 1 for label, d in diffs.items() if not label.startswith("pp 2"))


def check_invariant_mode(result) -> None:
    """Equal to the last bit: the invariant mode"""
    diffs, seconds = result
    assert all(d.name is None for d in diffs.values()), {k: str(d) for k, d in diffs.items()}
    assert all(lo <= med <= hi and lo > 0 for med, lo, hi in seconds.values())


def check_spike_skipped(plain, guarded, bad_step) -> None:
    """A loss spike without a NaN: the outlier batch's norm jumps; unguarded, the held-out loss jumps and is still
    above its pre-spike value at the end; guarded, that one step is skipped and the loss never rises"""
    before = plain["loss"][bad_step - 1]
    assert plain["skipped"] == [] and plain["norm"][bad_step] > 100 * max(plain["norm"][:bad_step])
    assert plain["loss"][bad_step] > 10 * before and plain["loss"][-1] > before
    assert all(torch.isfinite(torch.tensor(plain["loss"])))                          # a spike, not a NaN
    assert guarded["skipped"] == [bad_step] and max(guarded["loss"][bad_step:]) <= before


def check_clipping_bounds_the_step(clipped, bad_step, clip) -> None:
    """Clipping at ``clip`` (far above the normal norms) takes the outlier step but bounds its length: the logged
    norm still shows the spike, nothing is skipped, and the held-out loss does not jump"""
    before = clipped["loss"][bad_step - 1]
    assert clipped["skipped"] == [] and clipped["norm"][bad_step] > 100 * clip > 100 * max(clipped["norm"][:bad_step])
    assert clipped["loss"][bad_step] < 1.05 * before


def check_clipping_handled_this_spike(clipped, guarded, plain) -> None:
    """A loss spike without a NaN: clipping at 1.0 handled this planted spike about as well as the skip guard
    (end losses within 0.02 of each other, both far below the unguarded run's), so the guard's case is the
    second spike (check_skip_guard_beats_clipping_on_a_corrupt_shard)"""
    assert abs(clipped["loss"][-1] - guarded["loss"][-1]) < 0.02, (clipped["loss"][-1], guarded["loss"][-1])
    assert max(clipped["loss"][-1], guarded["loss"][-1]) < plain["loss"][-1]


def check_skip_guard_beats_clipping_on_a_corrupt_shard(plain, clipped, guarded, bad_step, bad_steps) -> None:
    """Several bad batches in a row whose gradients point the wrong way: the guard skips every one and ends
    below its pre-spike loss; clipping takes each at bounded length and ends above it, worse than the guard
    by more than 0.01; unguarded is worse still"""
    before = plain["loss"][bad_step - 1]
    assert guarded["skipped"] == list(range(bad_step, bad_step + bad_steps)) and guarded["loss"][-1] < before
    assert clipped["skipped"] == [] and clipped["loss"][-1] > before
    assert clipped["loss"][-1] > guarded["loss"][-1] + 0.01 and plain["loss"][-1] > clipped["loss"][-1]

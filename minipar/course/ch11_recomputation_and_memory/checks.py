"""Checks for chapter 11's exercise: place checkpoints (none / selective / full per block) to meet an
activation-memory budget with as little recomputation as possible.

The costs are real: bytes kept per block measured with :func:`minipar.recompute.activation_bytes_per_block`
and extra FLOPs per block counted with :func:`minipar.recompute.step_flops`, on a tiny GPT. The learner's
plan is applied to that model with :func:`minipar.recompute.apply_recompute` (so it must be a valid plan),
its kept bytes are measured again (not summed from the table), and its extra FLOPs are compared with the
best plan found by trying every mix.
"""
from __future__ import annotations

import functools

import torch

from minipar.course.checks import fail

__all__ = ["costs", "best_extra_flops", "check_place_checkpoints"]

N_BLOCKS, BATCH, SEQ = 4, 2, 64


@functools.lru_cache(maxsize=1)
def costs() -> tuple:
    """(cfg, {mode: bytes kept per block}, {mode: extra FLOPs per block}) for the exercise's model."""
    from minipar.models import GPTConfig, TinyGPT
    from minipar.recompute import MODES, activation_bytes_per_block, apply_recompute, step_flops
    cfg = GPTConfig(n_layer=N_BLOCKS, n_embd=32, n_head=4, block_size=SEQ, dropout=0.0)
    kept = {m: activation_bytes_per_block(cfg, m, BATCH, SEQ) for m in MODES}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(cfg.vocab_size, (BATCH, SEQ), generator=g)
    flops = {m: step_flops(apply_recompute(TinyGPT(cfg), m), x, x) for m in MODES}
    extra = {m: (flops[m] - flops["none"]) // N_BLOCKS for m in MODES}
    return cfg, kept, extra


def best_extra_flops(kept: dict, extra: dict, n_blocks: int, budget: int):
    """The least extra FLOPs of any plan keeping at most ``budget`` bytes (None if no plan fits)."""
    best = None
    for n_full in range(n_blocks + 1):
        for n_sel in range(n_blocks - n_full + 1):
            n_none = n_blocks - n_full - n_sel
            bytes_ = n_full * kept["full"] + n_sel * kept["selective"] + n_none * kept["none"]
            cost = n_full * extra["full"] + n_sel * extra["selective"]
            if bytes_ <= budget and (best is None or cost < best):
                best = cost
    return best


def _measured_kept(cfg, plan) -> int:
    """Bytes the forward of the blocks keeps alive (the plan applied to a real model), minus the output."""
    from minipar.memory import LiveTensorTracker
    from minipar.models import TinyGPT
    from minipar.recompute import apply_recompute
    model = apply_recompute(TinyGPT(cfg), plan)
    x0 = torch.randn(BATCH, SEQ, cfg.n_embd, requires_grad=True)
    tracker = LiveTensorTracker()
    with tracker:
        x = model.blocks[0](x0)            # block 0's input x0 was made outside: count it by hand below
        for block in model.blocks[1:]:
            x = block(x)
    return tracker.current - x.numel() * x.element_size() + x0.numel() * x0.element_size()


def check_place_checkpoints(place_checkpoints) -> None:
    """``place_checkpoints(kept, extra, n_blocks, budget)`` -> a list of ``n_blocks`` modes ("none",
    "selective", "full") keeping at most ``budget`` bytes with the least extra FLOPs; ``ValueError`` if
    even full recomputation everywhere does not fit."""
    cfg, kept, extra = costs()
    n = N_BLOCKS
    budgets = [n * kept["none"], 3 * kept["none"] + kept["selective"], 2 * kept["none"] + 2 * kept["full"],
               n * kept["selective"], kept["selective"] + 3 * kept["full"], n * kept["full"]]
    for budget in budgets:
        plan = place_checkpoints(dict(kept), dict(extra), n, budget)
        what = f"place_checkpoints(budget={budget:,} bytes) with kept per block {kept}"
        if not isinstance(plan, (list, tuple)) or len(plan) != n or any(m not in kept for m in plan):
            fail(what, f"a list of {n} modes from {list(kept)}", plan, "one mode per block")
        measured = _measured_kept(cfg, list(plan))
        cost = sum(extra[m] for m in plan)
        best = best_extra_flops(kept, extra, n, budget)
        if measured > budget * 1.01:          # the table is measured too; 1% for LayerNorm-sized noise
            fail(what + ": bytes kept, measured", f"<= {budget:,}", f"{measured:,} for plan {list(plan)}",
                 "the plan does not fit: recompute more (selective frees the s² terms, full all but the input)")
        if cost > best:
            fail(what + ": extra FLOPs", f"{best:,} (the cheapest plan that fits)", f"{cost:,} for {list(plan)}",
                 "recomputes more than needed: prefer keeping blocks whole, then selective (cheap: only the "
                 "attention core), full only where the budget demands it")
    try:
        plan = place_checkpoints(dict(kept), dict(extra), n, n * kept["full"] - 1)
    except ValueError:
        pass
    else:
        fail("a budget below full recomputation everywhere", "ValueError (no plan fits)", plan,
             "check the smallest possible memory (every block full) first and raise ValueError")
    print(f"place_checkpoints: the cheapest plan that fits, for {len(budgets)} budgets from {n} blocks "
          f"kept whole to {n} blocks fully recomputed (bytes measured on the real model), and ValueError below")

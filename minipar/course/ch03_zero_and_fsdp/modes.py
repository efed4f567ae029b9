"""Chapter 03: PyTorch FSDP's sharding modes, each run here as the ZeRO variant it is, measured on 4 ranks.

    FSDP (FSDP1 ShardingStrategy / FSDP2 option)    here                                       collectives per unit per step
    FULL_SHARD / reshard_after_forward=True         ZeRO-3                                     2 all-gathers + 1 reduce-scatter
    SHARD_GRAD_OP / reshard_after_forward=False     ZeRO-3 gathered once per step              1 all-gather + 1 reduce-scatter
    (no FSDP mode: DeepSpeed's ZeRO-2)              ZeRO-2, parameters whole between steps     1 reduce-scatter + 1 all-gather
    HYBRID_SHARD (2-D mesh dp_replicate×dp_shard)   HSDP: ZeRO-3 in a node, all-reduce across  in-node ZeRO-3 + a shard all-reduce
    (FULL_SHARD's separate stream)                  ZeRO-3, reduce-scatters posted async       as FULL_SHARD

SHARD_GRAD_OP is not ZeRO-2. PyTorch's docstring of ``ShardingStrategy.SHARD_GRAD_OP``: parameters "are sharded
outside computation"; it "unshards before the forward, does not reshard them after the forward, and only
reshards them after the backward computation" -- FSDP2's ``reshard_after_forward=False``. So between steps it
holds ZeRO-3's shards. minipar's stand-in (``once_per_step``, built for pipelines) has its collectives and its
bytes between steps, but keeps the full gradients until the step's end, so its peak is above PyTorch's by up to
one full gradient. The ZeRO-2 row is the contrast: parameters kept whole between steps.

Each mode trains the chapter's tiny GPT (Adam, 2 steps: the second runs with Adam's state in place) on 4 ranks
(HSDP: declared as 2 nodes of 2) and is compared with one device; per rank and step: the bytes its log recorded,
the collectives, the model-state bytes it holds between steps and the step's measured peak (live tensors + the
storage ZeRO resizes by hand).
"""
from __future__ import annotations

import statistics

from minipar import comm
from minipar.check import RunResult, compare, gpt_recipe, train_reference
from minipar.data import hsdp
from minipar.data.zero import ZeRO, block_units
from minipar.data.zero_measure import measure_peak, measured_zero_state_bytes
from minipar.launcher import launch
from minipar.loop import mean_over_ranks, shard_batch

__all__ = ["MODES", "run_modes", "table_text"]

MODES = {"FULL_SHARD": dict(stage=3), "SHARD_GRAD_OP (gathered once)": dict(stage=3, once_per_step=True),
         "ZeRO-2 (DeepSpeed, not FSDP)": dict(stage=2), "HYBRID_SHARD (2 nodes of 2)": dict(stage=3, hybrid=True),
         "FULL_SHARD, async reduce-scatter": dict(stage=3, async_reduce=True)}


def _recipe():
    return gpt_recipe(steps=2, batch_size=8, seq_len=16, optimizer="adam")


def _mode_on_rank(rank, world_size, recipe, stage, once_per_step=False, hybrid=False, async_reduce=False):
    node, cross = hsdp.node_groups(world_size, 2) if hybrid else (None, None)
    model = recipe.model().to(recipe.dtype)
    zero = ZeRO(model, recipe.optimizer, stage, node, block_units(model), once_per_step=once_per_step,
                replicate_group=cross, async_reduce=async_reduce)
    losses, sent, observed, calls, peak = [], [], [], [], 0
    for batch in recipe.batches:
        x, y = shard_batch(batch, rank, world_size)

        def step():
            zero.zero_grad()
            if once_per_step:
                zero.gather_for_step()                 # the parameters once, kept through forward and backward
            loss = recipe.loss(model, x, y)
            loss.backward()
            zero.step()
            return loss.detach()
        with comm.recording() as log:
            loss, p = measure_peak(zero, step)
        sent.append(log.bytes_sent)
        observed.append(log.observed_bytes_sent)
        calls.append(sum(r.op in ("all_gather", "reduce_scatter", "all_reduce") for r in log.records))
        peak = max(peak, p)
        losses.append(mean_over_ranks(loss))
    states = sum(measured_zero_state_bytes(zero).values())
    wire = None if None in observed else statistics.mean(observed)
    return RunResult(losses, zero.full_parameters()), statistics.mean(sent), statistics.mean(calls), states, peak, wire


def _all_on_rank(rank, world_size, recipe, names):
    return {name: _mode_on_rank(rank, world_size, recipe, **MODES[name]) for name in names}


def run_modes(world_size: int = 4, names=tuple(MODES)) -> dict:
    """{mode: {"matches", "max_abs_diff", "bytes", "calls", "between", "peak", "observed"}} (rank 0's bytes and
    calls, the wire's mean over ranks; the largest states and peak over the ranks), every mode in one launch."""
    recipe = _recipe()
    reference = train_reference(recipe)
    per_rank = launch(_all_on_rank, world_size, recipe, names, quiet=True)
    out = {}
    for name in names:
        rows = [r[name] for r in per_rank]
        c = compare(reference, [r[0] for r in rows])
        out[name] = {"matches": c.matches, "max_abs_diff": c.max_abs_diff, "bytes": rows[0][1], "calls": rows[0][2],
                     "between": max(r[3] for r in rows), "peak": max(r[4] for r in rows),
                     "observed": None if any(r[5] is None for r in rows) else statistics.mean(r[5] for r in rows)}
    return out


# Model-state bytes between steps, FP32 Adam (16 bytes a parameter), N ranks: (formula text, bytes).
BETWEEN = {"FULL_SHARD": ("16Ψ/N", lambda psi, n: 16 * psi // n),
           "SHARD_GRAD_OP (gathered once)": ("16Ψ/N", lambda psi, n: 16 * psi // n),
           "ZeRO-2 (DeepSpeed, not FSDP)": ("4Ψ + 12Ψ/N", lambda psi, n: 4 * psi + 12 * psi // n),
           "HYBRID_SHARD (2 nodes of 2)": ("16Ψ/(N/2)", lambda psi, n: 16 * psi // (n // 2)),
           "FULL_SHARD, async reduce-scatter": ("16Ψ/N", lambda psi, n: 16 * psi // n)}


def parameter_count() -> int:
    """Ψ of the modes' model (its units need no padding on 4 ranks)."""
    return sum(p.numel() for p in _recipe().model().parameters())


def table_text(modes: dict, world_size: int = 4) -> str:
    psi = parameter_count()
    lines = [f"bytes per rank; Ψ = {psi:,} parameters, N = {world_size}, FP32 Adam (16 bytes a parameter)",
             f"{'FSDP mode':34s} {'= one device':>12s} {'bytes/step':>11s} {'collectives':>11s} "
             f"{'states between steps':>21s} {'formula':>19s} {'peak':>9s}"]
    for name, m in modes.items():
        text, formula = BETWEEN[name]
        lines.append(f"{name:34s} {str(m['matches']):>12s} {m['bytes']:>11,.0f} {m['calls']:>11.0f} "
                     f"{m['between']:>21,} {formula(psi, world_size):>8,} {text:>10s} {m['peak']:>9,}")
    return "\n".join(lines)

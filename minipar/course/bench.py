"""Benchmarks: ``python -m minipar bench <name>`` runs the ``main`` a chapter's ``bench.py`` registers in
``BENCHMARKS = {name: main}``.

Speed is measured here, never in timed tests. A benchmark runs minipar's implementation and PyTorch's own
on the same model and batch inside one launch, alternating step by step (this machine is noisy: what
matters is the ratio of medians measured side by side), and prints the medians and their ratio.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch.distributed as dist

__all__ = ["alternating_medians", "model_and_batch", "benchmarks", "main"]


def alternating_medians(steps: dict, iters: int = 20, warmup: int = 3, group=None) -> dict:
    """On every rank: time each callable in ``steps`` once per round, alternating their order each round,
    with a barrier before and after each so that every rank times the same work. Returns
    ``{name: median seconds}`` (wall time of the slowest rank is what the barrier exposes)."""
    names = list(steps)
    times = {n: [] for n in names}
    for i in range(warmup + iters):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            dist.barrier(group)
            t0 = time.perf_counter()
            steps[name]()
            dist.barrier(group)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def model_and_batch(layers, embd, batch, seq, seed=0):
    """(a TinyGPT factory, one (inputs, targets) batch) of the given size: what the benchmarks train."""
    from minipar.datasets import lm_batch, markov_tokens
    from minipar.models import GPTConfig, TinyGPT
    cfg = GPTConfig(n_layer=layers, n_embd=embd, n_head=4, block_size=seq, vocab_size=256)
    tokens = markov_tokens(8192, cfg.vocab_size, seed=seed)
    return (lambda: TinyGPT(cfg, seed=seed)), lm_batch(tokens, batch, seq, 0, seed=seed)


def benchmarks() -> dict:
    """{name: main} over every chapter's ``bench.py``."""
    from . import collect
    found = {}
    for _, registered in collect("bench", "BENCHMARKS"):
        found.update(registered)
    return found


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    available = benchmarks()
    if not argv or argv[0] not in available:
        print(f"usage: python -m minipar bench {{{','.join(sorted(available)) or '(none yet)'}}} [options]",
              file=sys.stderr)
        return 2
    return available[argv[0]](argv[1:]) or 0

"""Benchmarks: ``python -m minipar bench <name>`` runs the ``main`` a chapter's ``bench.py`` registers in
``BENCHMARKS = {name: main}``; ``python -m minipar bench --help`` lists them, each with the first sentence of
its ``main``'s docstring (else of its module's).

Speed is measured here, never in timed tests. A benchmark runs minipar's implementation and PyTorch's own
on the same model and batch inside one launch, alternating step by step (this machine is noisy: what
matters is the ratio of medians measured side by side), and prints the medians and their ratio.
"""
from __future__ import annotations

import re
import statistics
import sys

from minipar.observe.paced_compute import alternating_steps

__all__ = ["alternating_medians", "model_and_batch", "benchmarks", "describe", "main"]


def alternating_medians(steps: dict, iters: int = 20, warmup: int = 3, group=None) -> dict:
    """On every rank: ``{name: median seconds}`` of each callable in ``steps``, timed once per round in
    alternating order, each call after a barrier and timed on the slowest rank
    (:func:`minipar.observe.paced_compute.alternating_steps`)."""
    times = alternating_steps(steps, iters, group=group, warmup=warmup)
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


def describe(run) -> str:
    """A benchmark's one line: the first sentence of ``run``'s docstring, else of its module's, without the
    usage it may open with (``python -m minipar bench name [...]``:) or reST markup."""
    doc = run.__doc__ or sys.modules[run.__module__].__doc__ or ""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    text = re.sub(r"^``python -m minipar bench [^`]*``:\s*", "", text)
    text = re.sub(r":\w+:`[~.]*([^`]*)`", r"\1", text).replace("``", "")
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def usage(available: dict) -> str:
    from minipar.__main__ import listing
    return "\n".join([f"usage: python -m minipar bench {{{','.join(sorted(available)) or '(none yet)'}}} [options]",
                      "", "benchmarks:", listing({name: describe(available[name]) for name in sorted(available)}),
                      "", "python -m minipar bench NAME --help: that benchmark's options"])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    available = benchmarks()
    if argv and argv[0] in ("-h", "--help"):
        print(usage(available))
        return 0
    if not argv or argv[0] not in available:
        unknown = f"python -m minipar bench: unknown benchmark {argv[0]!r}\n" if argv else ""
        print(unknown + usage(available), file=sys.stderr)
        return 2
    return available[argv[0]](argv[1:]) or 0

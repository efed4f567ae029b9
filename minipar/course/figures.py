"""The course's pictures, made from real runs and from the library's own data, never drawn by hand.

Each chapter's ``minipar/course/chNN_topic/figures.py`` defines ``FIGURES``: a dict from a file name
(``"04_gpipe.png"``) to a function ``make(path)`` that writes that picture. ``python -m minipar
figures`` (or ``make figures``) regenerates every one into ``figures/``; ``-k`` selects by name.
"""
from __future__ import annotations

import os
import sys
import time

__all__ = ["all_figures", "generate", "main"]


def all_figures() -> dict:
    """{file name: make(path)} over every chapter module, in chapter order."""
    from . import collect
    found = {}
    for _, figures in collect("figures", "FIGURES"):
        found.update(figures)
    return found


def generate(outdir: str | None = None, select: str | None = None, progress=None) -> list:
    progress = progress or sys.stderr
    import matplotlib
    matplotlib.use("Agg")
    from . import ROOT
    outdir = str(ROOT / "figures") if outdir is None else outdir
    os.makedirs(outdir, exist_ok=True)
    from ..progress import bar
    written = []
    chosen = [(name, make) for name, make in all_figures().items() if not select or select in name]
    steps = bar(chosen, desc="figures", unit="figure")
    for name, make in steps:
        t0 = time.perf_counter()
        path = os.path.join(outdir, name)
        make(path)
        steps.write(f"wrote {path} ({time.perf_counter() - t0:.1f} s)", file=progress)
        written.append(path)
    return written


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m minipar figures")
    parser.add_argument("--out", default=None, help="default: the repository's figures/")
    parser.add_argument("-k", dest="select")
    args = parser.parse_args(argv)
    generate(args.out, args.select)
    return 0

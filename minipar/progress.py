"""Progress bars for long loops (training steps, the tour, benchmarks, figures), with tqdm.

    from minipar.progress import bar
    for step in bar(range(steps), desc="training"):
        ...

Where it draws:

* in a notebook: tqdm's widget bar, under the cell;
* in a terminal: tqdm's text bar on stderr; when stderr is not a terminal (a CI log, a pipe) nothing,
  so logs stay readable (``disable=False`` forces it);
* inside a rank started by :func:`minipar.launch`: only rank 0 draws, in plain ASCII, at most every two
  seconds, on the rank's stdout. ``launch(..., stream=True)`` shows each redraw as a line
  ``[rank 0] training:  40%|####      | 4/10 ...``; the default (captured) launch shows the last state after
  the run.
"""
from __future__ import annotations

import os
import sys
from typing import Iterable, TypeVar

__all__ = ["bar", "in_notebook"]

T = TypeVar("T")


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, nbclient), where a widget bar can be shown."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return type(shell).__name__ == "ZMQInteractiveShell"


def _rank() -> int | None:
    """This process's rank when it is one of several ranks (a launched or torchrun process), else None."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - no torch.distributed: not a rank
        pass
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def bar(iterable: Iterable[T] | None = None, desc: str | None = None, total: int | None = None, *,
        unit: str = "it", leave: bool = True, disable: bool | None = None, **tqdm_kwargs):
    """A progress bar around ``iterable`` (or a manual one: ``with bar(total=n) as b: b.update()``).

    ``desc`` labels it, ``total`` sets the length when ``len(iterable)`` does not exist. ``disable=None``
    chooses as described in the module's docstring; True or False decides. Other keywords go to tqdm.
    """
    rank = _rank()
    if rank is not None:                                    # in a rank: plain text on the captured stdout
        from tqdm import tqdm
        options = dict(file=sys.stdout, ascii=True, ncols=80, mininterval=2.0)
        return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave,
                    disable=(rank != 0) if disable is None else disable, **{**options, **tqdm_kwargs})
    if in_notebook():
        try:
            from tqdm.notebook import tqdm as notebook_tqdm
            return notebook_tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave,
                                 disable=False if disable is None else disable, **tqdm_kwargs)
        except ImportError:                                 # no ipywidgets: the text bar below
            pass
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, disable=disable,
                **{"file": sys.stderr, **tqdm_kwargs})

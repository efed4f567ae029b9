"""How ``python -m minipar train``'s ranks print their progress lines on the command's own stdout and stderr.

A forked rank inherits the command's file descriptors and writes to them; a spawned one (NCCL: CUDA forbids
fork) inherits none but its own stdout/stderr, which the launcher captures. So a spawned rank appends its lines
to two files, and :class:`ProgressRelay`, a thread in the command, copies them onto the terminal as they arrive.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading

__all__ = ["write_progress", "ProgressRelay"]


def write_progress(where, text: str) -> None:
    """Write a progress line to ``where``: a file descriptor the rank inherited (forked ranks, torchrun), or
    the path of a file the launching process relays (spawned ranks inherit no descriptor)."""
    if isinstance(where, int):
        os.write(where, text.encode())
    else:
        with open(where, "a") as f:
            f.write(text)


class ProgressRelay:
    """Copy what spawned ranks append to two files onto this process's stdout and stderr, as it arrives."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="minipar-train-")
        self.paths = tuple(os.path.join(self.folder, name) for name in ("out", "err"))
        self.offsets = [0, 0]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        for i, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[i])
                    data = f.read()
            except FileNotFoundError:
                continue
            cut = data.rfind(b"\n") + 1              # whole lines only; the rest on the next pass
            if cut:
                os.write(1 + i, data[:cut])
                self.offsets[i] += cut

    def _run(self) -> None:
        while not self.done.wait(0.1):
            self._copy()

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self._copy()
        shutil.rmtree(self.folder, ignore_errors=True)

"""Bytes this process really put on the wire, observed, not modelled.

:mod:`minipar.comm` logs what an algorithm *should* send (its model). This module reads what the process
*did* send: the kernel's per-process I/O counter ``wchar`` in ``/proc/self/io`` (Linux), which counts every
byte the process handed to ``write``/``writev``/``send`` — gloo's TCP pairs write their messages with
``writev``, so around a collective the difference of ``wchar`` is the bytes this rank sent to its peers,
headers included. It belongs to this process only, so other programs on a shared machine do not disturb it
(the loopback interface's counters, ``/proc/net/dev``, are machine-wide and do).

How it can be fooled, and what we do about it:

* anything else the process writes inside the measured block counts too — a ``print`` (a few bytes into
  the launcher's output file), a checkpoint, a FileStore key. Measure blocks that only compute and
  communicate; :func:`observing` records the count of write calls (``syscw``) so a surprise shows up.
* a transport that does not go through the kernel (NCCL over NVLink, shared memory, RDMA) is invisible:
  on such a backend :attr:`Observed.bytes_sent` is the socket traffic only. On this course's CPU/gloo
  path every byte between ranks crosses a TCP socket.
* not Linux: ``/proc/self/io`` is missing and :func:`available` is False; callers show "-".

Gloo's TCP transport starts every write with a 48-byte header (``gloo/transport/tcp/pair.h``), and a message
takes about three writes between its two ends (the data, and the notices that a buffer is ready): chapter 00
measures 144 B a message, so observed ≥ modelled by that much per message sent.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

__all__ = ["available", "counters", "written", "Observed", "observing", "CallCounter", "counting_calls",
           "GLOO_HEADER_BYTES"]

GLOO_HEADER_BYTES = 48    # per write on gloo's TCP transport (chapters 00 and 05 measure it)
_IO = "/proc/self/io"


def available() -> bool:
    return os.path.exists(_IO)


def _parse(data: bytes) -> dict:
    out = {}
    for line in data.decode().splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


def counters() -> dict:
    """{'wchar': bytes written, 'syscw': write calls, 'rchar': ..., 'syscr': ...} for this process."""
    with open(_IO, "rb", buffering=0) as f:
        return _parse(f.read(1024))


def written() -> int | None:
    """Bytes this process has written so far (``wchar``); None off Linux."""
    return counters()["wchar"] if available() else None


class CallCounter:
    """The wire counter as a hook (:mod:`minipar.hooks`): each blocking call's record gets ``observed_sent``,
    the bytes this process wrote while the call ran. It keeps ``/proc/self/io`` open while it counts (seek to
    0 and read again: ~7 µs, against ~40 µs to open and parse it each time, twice per call). The file is
    the opening process's own: in a process forked from it the counter counts nothing. None of this off Linux."""

    def __init__(self):
        self.reader = open(_IO, "rb", buffering=0) if available() else None
        self.pid = os.getpid()

    def written(self) -> int | None:
        if self.reader is None or os.getpid() != self.pid:      # /proc/self was the parent's when opened
            return None
        self.reader.seek(0)
        data = self.reader.read(1024)
        start = data.index(b"wchar:") + 6
        return int(data[start: data.index(b"\n", start)])

    def around_call(self, call, proceed):
        before = None if call.async_op else self.written()
        result = proceed()
        if before is not None:                 # an async call's bytes leave after it returns: not counted
            call.record.observed_sent = self.written() - before
        return result

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


@contextlib.contextmanager
def counting_calls():
    """A :class:`CallCounter`, closed when the block ends (install it with ``minipar.hooks.installed``)."""
    counter = CallCounter()
    try:
        yield counter
    finally:
        counter.close()


@dataclass
class Observed:
    """What the process wrote between entering and leaving an :func:`observing` block."""
    bytes_sent: int | None = None       # None where the counters are not available
    write_calls: int | None = None


@contextlib.contextmanager
def observing():
    """``with observing() as seen: ...`` then ``seen.bytes_sent``: bytes this rank sent inside the block.

    Collectives that return before their bytes are out (``async_op=True`` without ``wait()``) are counted
    only as far as they got: wait for them inside the block."""
    seen = Observed()
    if not available():
        yield seen
        return
    before = counters()
    try:
        yield seen
    finally:
        after = counters()
        seen.bytes_sent = after["wchar"] - before["wchar"]
        seen.write_calls = after["syscw"] - before["syscw"]

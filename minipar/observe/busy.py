"""Was the machine quiet enough for a timed run? The rules a paced run (:mod:`minipar.observe.paced_compute`) is
judged by before its step times are compared: slots that ran long, ranks that woke late from their slots, and
other processes' CPU while it ran (:class:`OtherWork`), or, where that cannot be read, the load average. A run
judged disturbed states no saving; the chapters print :func:`too_busy`'s line instead."""
from __future__ import annotations

import os
import time

__all__ = ["DISTURBED_SHARE", "BUSY_LOAD_PER_CORE", "LATE_WAKE_S", "OTHER_CORES", "OtherWork", "disturbed", "too_busy",
           "run_disturbed", "run_too_busy"]

DISTURBED_SHARE = 0.05    # more slots than this share ran long: the machine was too busy for the slots
BUSY_LOAD_PER_CORE = 2    # a load average above this many per core: ranks wake late from their slots
LATE_WAKE_S = 0.001       # a median wake-up later than this after its slot's end: other work held the cores
                          # (chapter 02's paced run on this 2-core machine: 0.19 ms quiet, 3.1 ms beside 3 busy loops)
OTHER_CORES = 0.25        # other processes' CPU while a run ran, in cores: more, and the cores were not the run's
                          # (make test's other streams: 1 to 2 cores; they left the wake-ups on time: 5 of 192 slots long)


def disturbed(overruns: int, held: int, load: float | None = None, cores: int | None = None,
              late: float | None = None, other: float | None = None) -> bool:
    """More than :data:`DISTURBED_SHARE` of the ``held`` slots ran long, or other work had the cores: measured when
    the run gives ``other`` (other processes' CPU while it ran, in cores: :class:`OtherWork`), over
    :data:`OTHER_CORES`, or ``late`` (the median of how late its ranks woke from their slots,
    :func:`minipar.observe.paced_compute.median_wake`),
    over :data:`LATE_WAKE_S`; else read from the machine's 1-minute ``load`` average, over :data:`BUSY_LOAD_PER_CORE`
    times its ``cores`` (``None``: this machine's, now). (A tie was seen at 7 % overruns, load average 23: overlap
    needs gloo's threads to run too. With more than twice as many runnable processes as cores a rank woken at its
    slot's end waits for a core without overrunning: a CI run idled chapter 04's 1F1B 44.5 % against 27.3 %
    simulated with no overrun. The load average also counts a chapter's earlier runs, a minute after they ended;
    and beside make test's other streams the ranks still woke on time, yet computed among them: a tie.)"""
    if overruns > DISTURBED_SHARE * held:
        return True
    if other is not None or late is not None:
        return (other is not None and other > OTHER_CORES) or (late is not None and late > LATE_WAKE_S)
    load, cores = _load(load, cores)
    return load > BUSY_LOAD_PER_CORE * cores


def too_busy(overruns: int, held: int, load: float | None = None, cores: int | None = None,
             late: float | None = None, other: float | None = None) -> str:
    """The line a disturbed run prints instead of comparing its times ("" when it was not disturbed)."""
    if not disturbed(overruns, held, load, cores, late, other):
        return ""
    load, cores = _load(load, cores)
    if overruns > DISTURBED_SHARE * held:
        why = (f"more than {DISTURBED_SHARE:.0%} of the slots ran long (load average {load:.1f} on {cores} cores): "
               "the cores were too busy for the slots")
    elif other is not None and other > OTHER_CORES:
        why = (f"other processes used {other:.1f} of the {cores} cores while it ran, over {OTHER_CORES}: the cores "
               f"were not the run's alone (load average {load:.1f})")
    elif late is not None and late > LATE_WAKE_S:
        why = (f"the ranks woke a median {late * 1e3:.1f} ms after their slots' ends, over {LATE_WAKE_S * 1e3:.0f} ms: "
               f"other work held the cores (load average {load:.1f} on {cores} cores)")
    else:
        why = f"load average {load:.1f} on {cores} cores, over {BUSY_LOAD_PER_CORE} a core: ranks wake late from their slots"
    return f"{why}, so the times are not compared; run the cell again on a quieter machine"


def run_disturbed(m: dict) -> bool:
    """:func:`disturbed` for a paced run's measurements ``m``: its "overruns", "slots" and "load", and its "late_s"
    and "other_cores" where it measured them."""
    return disturbed(m["overruns"], m["slots"], m["load"], late=m.get("late_s"), other=m.get("other_cores"))


def run_too_busy(m: dict) -> str:
    """:func:`too_busy`'s line for a paced run's measurements ``m`` (as :func:`run_disturbed` reads them)."""
    return too_busy(m["overruns"], m["slots"], m["load"], late=m.get("late_s"), other=m.get("other_cores"))


class OtherWork:
    """``with OtherWork() as other: launch(...)``; then ``other.cores``: how many cores' worth of CPU other processes
    used while the block ran, the machine's busy CPU (``/proc/stat``) less this process's and its reaped children's
    (a launch's ranks). ``None`` where ``/proc/stat`` is missing (not Linux): :func:`disturbed` then reads the load
    average."""

    def __enter__(self):
        self.cores = None
        self._start, self._busy, self._own = time.monotonic(), _machine_busy_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc):
        busy, wall = _machine_busy_s(), time.monotonic() - self._start
        if busy is not None and self._busy is not None and wall > 0:
            self.cores = max(0.0, (busy - self._busy) - (_own_cpu_s() - self._own)) / wall
        return False


def _machine_busy_s() -> float | None:
    """Seconds of CPU the whole machine spent busy since boot (user, nice, system, irq, softirq, steal), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    import resource
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _load(load: float | None, cores: int | None) -> tuple:
    """(1-minute load average, cores): the given ones, or this machine's now."""
    return (os.getloadavg()[0] if load is None else load), ((os.cpu_count() or 1) if cores is None else cores)

"""Run one function on N ranks: from a notebook cell, a script, a test, or under ``torchrun``.

    results = launch(fn, 4, *args)      # fn(rank, world_size, *args) on ranks 0..3

Each rank is a separate process with its own ``torch.distributed`` process group (gloo by default), so
the code a chapter runs is the code that runs on a GPU cluster. What the launcher guarantees:

* rendezvous through a ``FileStore`` in a fresh temporary directory (no fixed ports to collide on);
* every rank calls ``torch.set_num_threads(1)`` first (fork after the parent used its thread pool would
  otherwise hang, and N ranks on a laptop should not fight over cores);
* each rank's output is captured and printed after the run in rank order, prefixed ``[rank r]``, so
  notebook output is deterministic; ``stream=True`` prints each line as it is written instead (same
  prefix, in the order the lines arrive), for long runs you want to watch;
* a rank that raises ends the whole run within seconds with :class:`RankError` naming the rank and carrying
  its traceback, even while the other ranks wait in a collective; a deadlock (a collective waiting longer
  than ``timeout``) ends with :class:`LaunchTimeout` naming the waiting rank; an interrupt stops every
  rank. No process is left behind.
* every rank keeps a :mod:`minipar.flight` recorder of its last communication calls; when the run fails, the
  error also says where the ranks' programs parted (the first call a rank never issued, or issued
  differently), when the recorders show it -- and then its first line names the rank that parted, which
  may not be the rank that failed. The recorder sees only calls through :mod:`minipar.comm`; a rank that
  failed in communication with none of those in flight is said to have called ``torch.distributed`` directly.
* a run that is making progress is never cut off: there is no overall time limit unless the caller asks for
  one with ``wall_limit=`` seconds.

The ranks are started with ``torch.multiprocessing.start_processes`` -- the function behind
``torch.multiprocessing.spawn`` that PyTorch's tutorials use. ``launch`` adds to it: the rendezvous, the
captured (or streamed) output, the root-cause error naming the rank, no orphans, and each rank's return value.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) the same call runs ``fn`` on this process's rank with
the environment's rendezvous and returns every rank's result, so a chapter's code is also a multi-node
script (NCCL on GPUs).
"""
from __future__ import annotations

import ctypes
import datetime
import io
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable
from multiprocessing import connection

import cloudpickle  # carries functions defined in a notebook cell to spawned ranks, unlike pickle
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import flight, hooks
from .validation import positive_int

__all__ = ["launch", "choose_backend_and_device", "RankError", "LaunchTimeout", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 60.0  # seconds a collective may wait before the run is declared deadlocked
START_TIMEOUT = 120.0   # seconds the ranks may take to all start (see _arrive_together)


def _hooked(fn, world_size: int):
    """(``fn`` wrapped by every active hook's ``around_launch`` (:mod:`minipar.hooks`; the outermost hook wraps
    last), the hooks' ``finish`` steps, outermost first). The launcher imports no instrument:
    :func:`minipar.observe.launch_trace.recording_launches` installs one such hook."""
    finishes = []
    for hook in reversed(hooks.active("around_launch")):
        fn, finish = hook.around_launch(fn, world_size)
        finishes.append(finish)

    def finish_all(results):
        for finish in reversed(finishes):
            results = finish(results)
        return results
    return fn, finish_all


class RankError(RuntimeError):
    """A rank raised (or died). ``rank`` is the first rank that failed; ``rank_traceback`` its traceback;
    ``flight`` the first call the ranks' records disagree on (:func:`minipar.flight.diagnose`), or None;
    ``headline`` who parted first (:func:`minipar.flight.headline`: the rank that never issued a call, or whose
    call differs), the error's first line when the recorders show it; ``note`` why there is no diagnosis,
    where that is known (:data:`minipar.flight.UNSEEN`: a rank stuck in a call made through
    ``torch.distributed`` directly)."""

    def __init__(self, rank: int, message: str, rank_traceback: str = "", output: str = "",
                 flight: str | None = None, *, headline: str | None = None, note: str | None = None):
        self.rank, self.rank_traceback, self.output, self.flight = rank, rank_traceback, output, flight
        self.headline, self.note = headline, note
        text = f"rank {rank} failed: {message}"
        if headline:                          # the culprit first: the failing rank may only be its victim
            text = f"{headline} (flight recorder)\n{text}"
        if note:
            text += f"\n({note})"
        if flight:
            text += f"\n\n--- the first call the ranks' records disagree on (flight recorder) ---\n{flight}"
        if rank_traceback:
            text += f"\n\n--- traceback on rank {rank} ---\n{rank_traceback.rstrip()}"
        if output.strip():
            text += f"\n\n--- output of rank {rank} ---\n{output.rstrip()}"
        super().__init__(text)


class LaunchTimeout(RankError):
    """The run did not finish in time: most likely a deadlock (a rank waits for a message never sent)."""


def describe_exit(exitcode: int) -> str:
    """'exited with code 3 (called os._exit or sys.exit)' or, for a negative code -n (killed by signal n),
    'was killed by SIGSEGV (signal 11: a segmentation fault, a crash in C/C++ code)'."""
    if exitcode is None or exitcode >= 0:
        return f"exited with code {exitcode} (called os._exit or sys.exit)"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        return f"was killed by signal {-exitcode}"
    why = _SIGNAL_MEANING.get(name, "")
    return f"was killed by {name} (signal {-exitcode}{': ' + why if why else ''})"


_SIGNAL_MEANING = {
    "SIGSEGV": "a segmentation fault, a crash in C/C++ code, e.g. reading a tensor whose storage was freed",
    "SIGKILL": "killed from outside, often the kernel's out-of-memory killer",
    "SIGTERM": "asked to terminate from outside",
    "SIGABRT": "aborted, e.g. a failed C++ assertion",
    "SIGBUS": "a bus error, e.g. shared memory that ran out",
    "SIGFPE": "an arithmetic fault in C code",
    "SIGINT": "interrupted (Ctrl-C)",
}



def _in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def choose_backend_and_device(requested: str, *, local_rank: int, cuda_available: bool,
                              device_count: int) -> tuple:
    """(backend, device) for a rank: ``"auto"`` is NCCL on GPU ``local_rank % device_count`` when CUDA is
    available, else gloo on the CPU; ``"gloo"`` is always the CPU; ``"nccl"`` without CUDA is a ValueError.
    Pure (the caller asks torch.cuda), so it is tested without a GPU."""
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {requested!r}")
    if requested == "gloo" or (requested == "auto" and not cuda_available):
        return "gloo", "cpu"
    if not cuda_available or device_count < 1:
        raise ValueError("the NCCL backend needs CUDA GPUs, and torch.cuda.is_available() is False here "
                         "(use --backend gloo or auto to train on the CPU)")
    return "nccl", f"cuda:{local_rank % device_count}"


def default_start_method(backend: str) -> str:
    """How :func:`launch` starts ranks: ``"fork"`` on Linux, ``"spawn"`` elsewhere and for NCCL (a forked
    child cannot use CUDA once the parent has asked torch.cuda about the GPUs). A spawned rank inherits no
    file descriptor but its own stdout/stderr, which the launcher captures."""
    return "fork" if sys.platform.startswith("linux") and backend != "nccl" else "spawn"


def launch(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo",
           timeout: float = DEFAULT_TIMEOUT, start_method: str | None = None,
           quiet: bool = False, stream: bool = False, wall_limit: float | None = None, **kwargs):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return the per-rank results.

    ``timeout`` bounds every collective: a rank that waits longer (a deadlock) fails with
    :class:`LaunchTimeout` naming it. Ranks that compute, however long, are never stopped, unless the
    caller gives ``wall_limit`` (seconds for the whole run; ``None``, the default, means no limit).
    ``start_method`` is ``"fork"`` on Linux by default and ``"spawn"`` elsewhere and with ``backend="nccl"``
    (each rank then makes GPU ``rank % device_count`` its current device; the function travels
    with cloudpickle, so notebook functions work). Output: by default printed after the run in rank order;
    ``stream=True`` prints each line as soon as a rank writes it, prefixed ``[rank r]``; ``quiet=True``
    prints nothing (the output is still attached to errors). Each active hook with ``around_launch``
    (:mod:`minipar.hooks`) wraps ``fn`` and finishes the results (:func:`minipar.observe.launch_trace.traced_launch`
    traces every rank so).
    """
    positive_int("world_size", world_size)
    fn, finish = _hooked(fn, world_size)
    if _in_torchrun():
        return finish(_launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout))
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("launch() was called from a process that already has a torch.distributed process "
                           "group; call fn directly there, or destroy the group first")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    if wall_limit is not None and not wall_limit > 0:
        raise ValueError(f"wall_limit must be positive seconds or None, got {wall_limit!r}")
    method = start_method or default_start_method(backend)
    if method == "fork":
        # torch.optim imports torch._dynamo lazily on the first optimizer; import it once here, or every
        # forked rank pays seconds of CPU for it on each launch.
        import torch._dynamo  # noqa: F401
    remove_stale_workdirs()
    workdir = tempfile.mkdtemp(prefix=f"minipar-{os.getpid()}-")
    payload = _dumps((fn, args, kwargs)) if method != "fork" else None
    direct = (fn, args, kwargs) if payload is None else None
    procs = []
    try:
        context = mp.start_processes(_rank_main, args=(world_size, workdir, backend, timeout, payload, direct),
                                     nprocs=world_size, join=False, daemon=True, start_method=method)
        procs = context.processes
        streamer = _Streamer(workdir, world_size) if stream and not quiet else None
        results = _wait(procs, workdir, timeout, wall_limit, streamer)
        if streamer is not None:
            streamer.poll(final=True)
        elif not quiet:
            _print_outputs([_read_output(workdir, r) for r in range(world_size)])
        return finish(results)
    finally:
        for p in procs:  # whatever happened (error, timeout, KeyboardInterrupt): no process survives us
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)


def remove_stale_workdirs(root: str | None = None) -> list:
    """Remove the ``minipar-<pid>-*`` folders whose launching process is gone (killed with SIGKILL, which no
    ``finally`` survives); a live launcher's folder is kept. Returns the folders removed."""
    root = root or tempfile.gettempdir()
    removed = []
    for name in os.listdir(root):
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "minipar" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)            # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
        except PermissionError:                  # alive, another user's
            pass
    return removed


def _wait(procs, workdir: str, timeout: float, wall_limit: float | None, streamer=None) -> list:
    """Collect every rank's result. No deadline of its own: a deadlock shows up as a rank whose collective
    timed out (that rank reports it); only an explicit ``wall_limit`` stops ranks that are still working."""
    world_size = len(procs)
    results: list = [None] * world_size
    done = [False] * world_size
    start = time.monotonic()
    while not all(done):
        if streamer is not None:
            streamer.poll()
        for rank, p in enumerate(procs):
            if done[rank] or p.exitcode is None:
                continue
            done[rank] = True
            status, value = _read_result(workdir, rank)
            if status == "ok":
                results[rank] = value
            else:
                if streamer is not None:
                    streamer.poll(final=True)
                _raise_root_cause(procs, workdir, timeout)
        if wall_limit is not None and time.monotonic() - start > wall_limit:
            if streamer is not None:
                streamer.poll(final=True)
            running = [r for r in range(world_size) if not done[r]]
            parted = _flight_diagnosis(workdir, world_size)
            raise LaunchTimeout(running[0], f"ranks {running} were still running at the wall-clock limit "
                                            f"of {wall_limit:g} s (wall_limit=)",
                                output=_read_output(workdir, running[0]), flight=parted.text,
                                headline=parted.headline)
        # Sleep until a rank exits (its sentinel), or until the next look at the streamed output and the wall
        # clock: a fixed 5 ms poll cost ~0.2 CPU-s per 10 s of launch on two loaded cores, for nothing.
        running = [p.sentinel for r, p in enumerate(procs) if not done[r]]
        if running:
            connection.wait(running, timeout=0.02 if streamer is not None else 0.2)
    return results


class _Streamer:
    """Print the ranks' output while they run: each complete line once, prefixed ``[rank r]``.

    A carriage return (a progress bar redrawing itself) also ends a line, so a bar shows up as it moves."""

    def __init__(self, workdir: str, world_size: int):
        self.paths = [os.path.join(workdir, f"out{r}.txt") for r in range(world_size)]
        self.offsets = [0] * world_size
        self.partial = [""] * world_size

    def poll(self, final: bool = False) -> None:
        printed = False
        for rank, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[rank])
                    data = f.read()
            except OSError:
                continue
            if not data and not (final and self.partial[rank]):
                continue
            if final:
                cut = len(data)
            else:  # hold back an incomplete line until the rest arrives
                cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
            self.offsets[rank] += cut
            text = self.partial[rank] + data[:cut].decode(errors="replace")
            lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            self.partial[rank] = "" if final else lines.pop()
            for line in lines:
                if line.strip():
                    print(f"[rank {rank}] {line}")
                    printed = True
        if printed:
            sys.stdout.flush()


def _lost_a_peer(message: str) -> bool:
    """gloo's words for 'the rank at the other end went away': a consequence, not a cause."""
    text = message.lower()
    return "peer" in text or "connection reset" in text or "connection closed" in text


def _raise_root_cause(procs, workdir, timeout) -> None:
    """A rank failed. Its peers may fail a moment later only because it left ("connection closed by
    peer"), and index order says nothing about who was first: wait briefly for the others, then blame the
    earliest failure that is not such a consequence. The caller's ``finally`` kills the rest."""
    grace = time.monotonic() + 1.0
    while time.monotonic() < grace and any(p.exitcode is None for p in procs):
        time.sleep(0.01)
    failures = []  # (is a consequence, time of failure, rank, exception)
    parted = _flight_diagnosis(workdir, len(procs))
    for rank, p in enumerate(procs):
        if p.exitcode is None:
            continue
        status, value = _read_result(workdir, rank)
        output = _read_output(workdir, rank)
        if status == "error":
            message, tb, timed_out, when = value
            communication = timed_out or _about_communication(message)
            # The culprit leads only when this rank failed in communication (it may be the victim); a rank's
            # own error (a full disk, a wrong shape it raised) is the cause, and says so first.
            said = {"flight": parted.text, "headline": parted.headline if communication else None,
                    "note": parted.unseen(rank, communication=communication)}
            if timed_out:
                exc = LaunchTimeout(rank, f"waited more than the {timeout:g} s collective timeout (a deadlock: "
                                          f"no rank sent what rank {rank} waits for)\n{message}", tb, output,
                                    **said)
            else:
                exc = RankError(rank, message, tb, output, **said)
            failures.append((_lost_a_peer(message), when, rank, exc))
        elif status == "missing":
            aborted = p.exitcode == -signal.SIGABRT                        # gloo aborts on mismatched calls
            exc = RankError(rank, f"process {describe_exit(p.exitcode)} without returning", output=output,
                            flight=parted.text, headline=parted.headline if aborted else None,
                            note=parted.unseen(rank, communication=aborted))
            failures.append((False, float("-inf"), rank, exc))
    raise min(failures, key=lambda f: f[:3])[3]


def _flight_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"flight{rank}.bin")


def _about_communication(message: str) -> bool:
    """Whether a rank's error came from the communication library (gloo's or NCCL's words, c10d's)."""
    text = message.lower()
    return any(word in text for word in ("gloo", "nccl", "c10d", "processgroup", "connection", "peer"))


class _Parted:
    """What the ranks' flight recorders say: ``text`` (:func:`minipar.flight.diagnose`), ``headline``
    (:func:`minipar.flight.headline`), and the records, for :meth:`unseen`."""

    def __init__(self, records: dict, text: str | None, headline: str | None):
        self.records, self.text, self.headline = records, text, headline

    def unseen(self, rank: int, communication: bool) -> str | None:
        """Why the recorders cannot say where ``rank`` got stuck: it failed in communication, no diagnosis was
        found, and its recorder holds no call in flight -- the call it failed in did not go through
        minipar.comm (:data:`minipar.flight.UNSEEN`). None otherwise."""
        if not communication or self.text is not None or rank not in self.records:
            return None
        mine = self.records[rank]
        if any(r["state"] != "completed" for r in mine):
            return None
        return f"{flight.UNSEEN}; rank {rank} recorded {len(mine)} minipar.comm call(s), none in flight"


def _flight_diagnosis(workdir: str, world_size: int) -> _Parted:
    """What the ranks' flight recorders say about where their calls parted (text None: they agree, or no
    files). Read while the workdir still exists; a rank still running is seen as it is at this moment."""
    records = {}
    for rank in range(world_size):
        try:
            records[rank] = flight.read(_flight_path(workdir, rank))
        except OSError:                     # the rank died before it started its recorder
            continue
    try:
        return _Parted(records, flight.diagnose(records), flight.headline(records))
    except Exception as exc:  # noqa: BLE001 - a diagnosis must never hide the failure it explains
        return _Parted({}, f"(the flight recorders could not be read: {type(exc).__name__}: {exc})", None)


# ----------------------------------------------------------------------------------------------------
# What runs in each rank's process
# ----------------------------------------------------------------------------------------------------

def _rank_main(rank, world_size, workdir, backend, timeout, payload, direct):
    _die_with_parent()
    torch.set_num_threads(1)
    out_path = os.path.join(workdir, f"out{rank}.txt")
    out = open(out_path, "w", buffering=1)
    # Redirect the file descriptors too, so output from C++ (gloo warnings) is captured as well.
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    os.environ["LOCAL_RANK"] = str(rank)  # what torchrun would set, for code that reads it
    try:
        if backend == "nccl":  # NCCL: one GPU per rank, current before the group is created
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))   # no GPU: torch says so
        fn, args, kwargs = direct if direct is not None else _loads(payload)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        _arrive_together(store, world_size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        with hooks.only(flight.FlightRecorder(_flight_path(workdir, rank))):   # the rank's own scope, for its life
            value = fn(rank, world_size, *args, **kwargs)
        _write_result(workdir, rank, ("ok", value))
        _leave_together(store, world_size, timeout)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        when = time.time()
        timed_out = "timeout" in str(exc).lower() or "timed out" in str(exc).lower()
        _write_result(workdir, rank, ("error", (f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                                                 timed_out, when)))
    finally:
        out.flush()
        # Skip interpreter teardown: destroying a process group whose peers are gone can block.
        os._exit(0)


def _arrive_together(store, world_size: int, timeout: float) -> None:
    """Wait on the store until every rank has started, allowing at least :data:`START_TIMEOUT` s: on a loaded
    machine the ranks may start seconds apart, and a short collective ``timeout`` (a deadlock test's 2 s)
    must not count that against ``init_process_group``'s connections."""
    if store.add("minipar/arrived", 1) == world_size:
        store.set("minipar/all_arrived", "1")
    store.wait(["minipar/all_arrived"], datetime.timedelta(seconds=max(timeout, START_TIMEOUT)))


def _leave_together(store, world_size: int, timeout: float) -> None:
    """Keep a rank that returned early (and its connections) alive until every rank has returned.

    gloo connects lazily: inside ``init_process_group`` and inside every ``new_group``. A rank that
    finished and left could make a peer still connecting fail with "connection closed by peer". The wait
    is on the store, not a collective, so it can never be matched against the user's own collectives. It
    has no deadline: a peer may compute for as long as it likes; if a peer fails instead, the parent
    reports that one and kills this rank."""
    if store.add("minipar/returned", 1) == world_size:
        store.set("minipar/all_returned", "1")
    while True:
        try:
            store.wait(["minipar/all_returned"], datetime.timedelta(seconds=timeout))
            return
        except RuntimeError:  # not yet: a peer is still working (or stuck, and the parent will say so)
            continue


def _die_with_parent() -> None:
    """On Linux, ask the kernel to kill this rank if the launching process dies (no orphans)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _write_result(workdir, rank, obj) -> None:
    path = os.path.join(workdir, f"result{rank}.pt")
    try:
        data = _dumps(obj)
    except Exception as exc:  # noqa: BLE001 - an unpicklable return value is the caller's error
        data = _dumps(("error", (f"the return value of rank {rank} cannot be pickled: {exc}",
                                 traceback.format_exc(), False, time.time())))
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)  # atomic: the parent never reads half a result


def _read_result(workdir, rank):
    path = os.path.join(workdir, f"result{rank}.pt")
    if not os.path.exists(path):
        return "missing", None
    with open(path, "rb") as f:
        return _loads(f.read())


def _read_output(workdir, rank) -> str:
    try:
        with open(os.path.join(workdir, f"out{rank}.txt"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _print_outputs(outputs) -> None:
    for rank, text in enumerate(outputs):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}")


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=cloudpickle)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False, pickle_module=pickle)


# ----------------------------------------------------------------------------------------------------
# Under torchrun
# ----------------------------------------------------------------------------------------------------

def _launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout):
    rank, env_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={env_world}")
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    value = fn(rank, world_size, *args, **kwargs)
    # Every rank returns every rank's result, as in the local launcher (objects travel over gloo).
    objects_group = dist.new_group(backend="gloo")
    results: list = [None] * world_size
    dist.all_gather_object(results, value, group=objects_group)
    dist.barrier(objects_group)  # nobody exits (and tears its connections down) while a peer still reads
    dist.destroy_process_group(objects_group)
    return results

"""A flight recorder: each rank's last N communication calls, readable after a hang or a crash.

Source: PyTorch's Flight Recorder for NCCL (torch.distributed docs, "Flight Recorder"; switched on there with
``TORCH_NCCL_TRACE_BUFFER_SIZE=N``, dumped on a timeout, read with ``torchfrtrace``). Here it is always on for
every call through :mod:`minipar.comm`, and it is written where the launching process can read it even while
the rank is stuck in a C++ wait or was killed: a per-rank file of ``capacity`` fixed-size slots, call ``seq``
in slot ``seq % capacity``, written when the call is issued and again (its state) when it completes. The file
is mapped into memory (``mmap``, shared): a record is a memory copy, no system call, and it lands in the page
cache the launcher reads, so nothing needs flushing. The text of a record is formatted once per op and group
(and per shape and dtype): a call fills in only its ``seq`` and ``k``. (Not ``os.pwrite``: a write would count in the process's
``wchar``, which :mod:`minipar.wire` reads as the bytes sent on the sockets.)

Each record is one JSON line padded with spaces to the slot size:

* ``seq``: this rank's calls through minipar.comm, counted from 1;
* ``group``: the process group's name, or ``p2p:src->dst:tag`` for a send/recv (the channel, both ends);
* ``k``: this rank's calls on that group, from 1 -- the k-th call of every member of a group is one
  collective, however many calls on other groups each member made in between (their ``seq`` differ);
* ``op``, ``ranks`` (the group's global ranks), ``shape`` and ``dtype`` of the call's tensor;
* ``state``: ``issued``, then ``completed`` when the call returns (an async call: when its work's ``wait()``
  returns, or ``is_completed()`` says so; a work nobody waits on stays ``issued``).

A :class:`FlightRecorder` is a hook (:mod:`minipar.hooks`): the launcher installs one in each rank it starts,
for the rank's lifetime (``with hooks.only(FlightRecorder(path)):``); :func:`active` finds it. It sees
the calls made through :mod:`minipar.comm` only: a program that calls ``torch.distributed`` directly leaves
no records (:data:`UNSEEN`).
"""
from __future__ import annotations

import json
import mmap
import os

import torch.distributed as dist

from . import hooks

__all__ = ["FlightRecorder", "active", "read", "diagnose", "headline", "DEFAULT_CAPACITY", "UNSEEN"]

DEFAULT_CAPACITY = 64
_STATE_AT = len('{"state":"')           # the state is the first field, fixed width: completion rewrites 9 bytes
_COMPLETED = b"completed"               # as wide as 'issued   '
_SHAPES_MAY_DIFFER = {"all_to_all"}     # uneven splits (MoE dispatch) are legitimate
UNSEEN = ("the flight recorder sees only calls made through minipar.comm: a collective called through "
          "torch.distributed directly leaves no record")


class FlightRecorder:
    """The last ``capacity`` calls of this rank, in fixed-size slots of the file at ``path``."""

    def __init__(self, path: str, capacity: int = DEFAULT_CAPACITY):
        self.path, self.capacity, self.seq = path, capacity, 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.slot_size = 256 + 8 * world       # room for the ranks list of the largest group
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, capacity * self.slot_size)
            self.slots = mmap.mmap(fd, capacity * self.slot_size)     # shared: the file's own pages
        finally:
            os.close(fd)
        self.calls_on = {}                     # group key -> calls this rank made on it
        self.groups = {}                       # group object -> (key, ranks as JSON), asked of torch once
        self.lines = {}                        # (op, group, peer, tag) -> (key, the line's text around k)
        self.tails = {}                        # (shape, dtype) -> the line's text from the shape on
        self.blank = b" " * (self.slot_size - 1) + b"\n"

    def _group(self, group):
        known = self.groups.get(group)
        if known is None:
            pg = dist.group.WORLD if group is None else group
            ranks = list(range(dist.get_world_size())) if pg is dist.group.WORLD else dist.get_process_group_ranks(pg)
            known = self.groups[group] = (getattr(pg, "group_name", None) or str(ranks), json.dumps(ranks))
        return known

    def _line_parts(self, op, group, peer, tag):
        """(group key, the record's text from ``"group"`` up to ``k``, from ``k`` up to ``"shape"``): the same
        for every call of ``op`` on this group or channel, so formatted once."""
        if peer is None:
            key, ranks = self._group(group)
        else:                                  # the channel src -> dst: a send and its recv share it
            me = self.rank
            src, dst = (me, peer) if op == "send" else (peer, me)
            key, ranks = f"p2p:{src}->{dst}:{tag}", f"[{min(me, peer)}, {max(me, peer)}]"
        parts = self.lines[op, group, peer, tag] = (key, f',"group":"{key}","k":',
                                                     f',"op":"{op}","ranks":{ranks},"shape":')
        return parts

    def issued(self, op: str, group=None, peer=None, tag: int = 0, tensor=None) -> int:
        """Write the record of a call about to run; returns its ``seq`` for :meth:`completed`."""
        self.seq += 1
        parts = self.lines.get((op, group, peer, tag))
        key, before_k, after_k = parts if parts is not None else self._line_parts(op, group, peer, tag)
        k = self.calls_on[key] = self.calls_on.get(key, 0) + 1
        tail = 'null,"dtype":null}' if tensor is None else self._tail(tensor.shape, tensor.dtype)
        line = f'{{"state":"issued   ","seq":{self.seq}{before_k}{k}{after_k}{tail}'.encode()
        if len(line) >= self.slot_size:        # a tensor of very many dims: keep the record, drop its shape
            line = line[:line.rindex(b',"shape"')] + b',"shape":null,"dtype":null}'
        offset = (self.seq % self.capacity) * self.slot_size
        self.slots[offset: offset + self.slot_size] = line + self.blank[len(line):]
        return self.seq

    def _tail(self, shape, dtype) -> str:
        tail = self.tails.get((shape, dtype))
        if tail is None:
            if len(self.tails) >= 1024:        # shapes that keep changing (variable lengths): bounded
                self.tails.clear()
            tail = self.tails[shape, dtype] = f'{list(shape)},"dtype":"{str(dtype)[6:]}"}}'
        return tail

    def completed(self, seq: int) -> None:
        if self.seq - seq < self.capacity:     # else its slot already holds a newer call (a late async wait)
            at = (seq % self.capacity) * self.slot_size + _STATE_AT
            self.slots[at: at + len(_COMPLETED)] = _COMPLETED

    def around_call(self, call, proceed):
        """The hook: the call written as issued before it runs, completed after it (an async one: when its
        work's wait returns, or is_completed says so)."""
        seq = self.issued(call.op, call.group, call.peer, call.tag, call.tensor)
        result = proceed()
        if call.async_op:
            return hooks.WorkDone(result, lambda: self.completed(seq))
        self.completed(seq)
        return result

    def close(self) -> None:
        self.slots.close()


def active() -> FlightRecorder | None:
    """The flight recorder active here (the innermost), or None: outside a rank the launcher started."""
    recorders = [h for h in hooks.active() if isinstance(h, FlightRecorder)]
    return recorders[-1] if recorders else None


def read(path: str) -> list:
    """The records in a recorder's file, sorted by ``seq`` (a slot being rewritten at that moment is skipped)."""
    with open(path, "rb") as f:
        data = f.read()
    records = []
    for line in data.split(b"\n"):
        line = line.strip(b" \0")
        if line:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            record["state"] = record["state"].strip()
            records.append(record)
    return sorted(records, key=lambda r: r["seq"])


def _what(r: dict) -> str:
    tensor = f"{r['dtype']}{r['shape']}" if r["dtype"] else "?"
    if r["group"].startswith("p2p:"):
        return f"{r['op']} on {r['group'][4:].rsplit(':', 1)[0]}, {tensor}"
    return f"{r['op']} over ranks {r['ranks']}, {tensor}"


def _signature(r: dict):
    if r["group"].startswith("p2p:"):          # a send meets a recv: compare what travels, not the op
        return r["dtype"], None if r["shape"] is None else _numel(r["shape"])
    return r["op"], r["dtype"], None if r["op"] in _SHAPES_MAY_DIFFER or r["shape"] is None else tuple(r["shape"])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _names(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _states(present: dict) -> str:
    waiting = [r for r, rec in present.items() if rec["state"] != "completed"]
    done = [r for r in present if r not in waiting]
    verb = "waits" if len(waiting) == 1 else "wait"
    parts = [f"{_names(waiting)} {verb} in it (issued, not completed)"] if waiting else []
    return "; ".join(parts + ([f"{_names(done)} completed it"] if done else []))


def _never_issued(rank, group, k, first_k, wrapped) -> bool:
    """Rank ``rank`` (not seen in call k on ``group``) surely never issued it: its window reaches back that far."""
    if rank not in wrapped:                    # no file: nothing known
        return False
    if (rank, group) in first_k:               # older records go first, so a later one would still be there
        return first_k[rank, group] <= k
    return not wrapped[rank]                   # no call there at all, and nothing of this rank was overwritten


def diagnose(records_by_rank: dict, most: int = 4) -> str | None:
    """Where the ranks' programs parted: on each group, the first call that a member never issued, or that
    members issued with a different op, dtype or shape -- what each rank did there, and who waits for whom;
    one paragraph per group (at most ``most``), the earliest first (by the issuing ranks' ``seq``), so a
    wait across two groups shows both ends. None when every call seen agrees. Calls match per group (the
    k-th call of each member); a rank missing from ``records_by_rank``, or whose older records were
    overwritten, is not judged where it cannot be."""
    found = _partings(records_by_rank)[:most]
    return "\n".join(_describe(records_by_rank, *f[1:]) for f in found) or None


def headline(records_by_rank: dict) -> str | None:
    """One line naming who parted first (the earliest place :func:`diagnose` finds), for the top of an error:
    the rank that never issued a call the others wait in, or the rank whose call differs from the others'
    (when more ranks agree than differ; else every side is named). None when every call seen agrees."""
    found = _partings(records_by_rank)
    if not found:
        return None
    _, group, k, present, missing, signatures = found[0]
    what = _what(next(iter(present.values())))
    if missing:
        return (f"{_names(missing)} parted from the others: never issued call #{k} ({what}), which "
                f"{_names(present)} issued")
    sides = sorted(signatures.values(), key=lambda ranks: (-len(ranks), ranks))
    where = group if group.startswith("p2p:") else f"ranks {next(iter(present.values()))['ranks']}"
    if len(sides[0]) > len(sides[1]):          # a majority agrees: the others are the culprits
        odd = sorted(r for ranks in sides[1:] for r in ranks)
        theirs = "; ".join(f"{_names(ranks)}: {_what(present[ranks[0]])}" for ranks in sides[1:])
        return (f"{_names(odd)} parted from the others at call #{k} on {where}: {theirs}, where "
                f"{_names(sides[0])} called {_what(present[sides[0][0]])}")
    return f"ranks disagree at call #{k} on {where}: " + " vs ".join(
        f"{_names(ranks)} {_what(present[ranks[0]])}" for ranks in sorted(sides))


def _partings(records_by_rank: dict) -> list:
    """[(first issuing seq, group, k, {rank: record}, ranks that never issued it, {signature: ranks})] -- the
    first disagreement on each group, the earliest first."""
    calls, members, first_k = {}, {}, {}
    wrapped = {rank: bool(recs) and recs[0]["seq"] > 1 for rank, recs in records_by_rank.items()}
    for rank, recs in records_by_rank.items():
        for r in recs:
            calls.setdefault((r["group"], r["k"]), {})[rank] = r
            members.setdefault(r["group"], r["ranks"])
            first_k[rank, r["group"]] = min(first_k.get((rank, r["group"]), r["k"]), r["k"])
    first_on = {}                              # group -> its first disagreement
    for (group, k), present in sorted(calls.items()):
        missing = [m for m in members[group] if m not in present and _never_issued(m, group, k, first_k, wrapped)]
        signatures = {}
        for rank, r in present.items():
            signatures.setdefault(_signature(r), []).append(rank)
        if (missing or len(signatures) > 1) and group not in first_on:
            first_on[group] = (min(r["seq"] for r in present.values()), group, k, present, missing, signatures)
    return sorted(first_on.values(), key=lambda f: f[:3])


def _describe(records_by_rank, group, k, present, missing, signatures) -> str:
    some = next(iter(present.values()))
    seqs = {rank: r["seq"] for rank, r in present.items() if r["seq"] != k}
    overall = ("; " + ", ".join(f"rank {rank}'s call #{s} overall" for rank, s in sorted(seqs.items()))
               if seqs else "")
    if missing:
        text = (f"{_names(missing)} never issued call #{k} ({_what(some)}){overall}; "
                f"{_states(present)} for {_names(missing)}")
        for m in missing:
            mine = [r for r in records_by_rank[m] if r["group"] == group]
            last = records_by_rank[m][-1] if records_by_rank[m] else None
            text += (f"\n  rank {m}'s last call: #{last['seq']} ({_what(last)}, {last['state']})" if last
                     else f"\n  rank {m} made no call")
            if mine and mine[-1] is not last:
                text += f"; its last on this group: #{mine[-1]['k']} ({mine[-1]['op']}, {mine[-1]['state']})"
        return text
    where = group if group.startswith("p2p:") else f"ranks {some['ranks']}"
    text = f"ranks disagree at call #{k} on {where}{overall}"
    for ranks in sorted(signatures.values()):
        states = sorted({present[r]["state"] for r in ranks})
        text += f"\n  {_names(ranks)}: {_what(present[ranks[0]])} ({' / '.join(states)})"
    return text

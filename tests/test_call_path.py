"""The per-call path (minipar.comm -> minipar.calls -> the active hooks) does only the work its active hooks
need (issue 51: DDP at PyTorch's speed): the hooks that have ``around_call`` are filtered once per scope, not
once per call; a ring-shaped call asks torch for its group's size only when a hook reads the traffic model (the
flight recorder, a rank's usual hook, does not), while the comm log still gets every byte; the flight
recorder's records are unchanged by its cached line pieces."""
import torch
import torch.distributed as dist

from minipar import comm, flight, hooks, launch


class _Around:
    def around_call(self, call, proceed):
        return proceed()


class _Launch:
    def around_launch(self, fn, world_size):
        return fn, lambda results: results


def test_active_hooks_with_a_method_are_filtered_once_per_scope():
    a, b, c = _Around(), _Launch(), _Around()
    with hooks.only(a, b):
        first = hooks.active("around_call")
        assert first == (a,) and hooks.active("around_call") is first     # the same tuple: not rebuilt
        assert hooks.active("around_launch") == (b,) and hooks.active() == (a, b)
        with hooks.installed(c):
            assert hooks.active("around_call") == (a, c)                    # a new scope filters its own
        assert hooks.active("around_call") is first
    assert hooks.active("around_call") == ()


def _rank(rank, world_size):
    asked = []
    world_size_of = dist.get_world_size

    def counting(group=None):
        asked.append(group)
        return world_size_of(group)

    t = torch.full((3, 2), float(rank + 1))
    comm.all_reduce(t, async_op=True).wait()   # the flight recorder alone is active; it learns the group once
    dist.get_world_size = counting            # this rank's process only (the launcher forks it)
    comm.all_reduce(t, async_op=True).wait()
    comm.reduce_scatter_tensor(torch.empty(3), t.reshape(-1).clone())
    asked_by_flight_alone = len(asked)
    with comm.recording() as log:
        comm.all_reduce(t.clone())
        comm.all_gather_into_tensor(torch.empty(12), t.reshape(-1))
    dist.get_world_size = world_size_of
    records = [(r.op, r.group_size, r.payload_bytes, r.sent_bytes, r.recv_bytes) for r in log.records]
    seen = [(r["op"], r["k"], r["ranks"], r["shape"], r["dtype"], r["state"]) for r in flight.read(flight.active().path)]
    return asked_by_flight_alone, records, t.tolist(), seen


def test_the_flight_recorder_alone_asks_no_group_size_and_the_log_still_counts_every_byte():
    for asked, records, summed, seen in launch(_rank, 2, quiet=True):
        assert asked == 0                    # the old path asked torch for N on every call
        assert summed == [[6.0, 6.0]] * 3
        s = 6 * 4                            # 6 float32; ring: 2(N-1)/N·S each way, all-gather (N-1)/N·S
        assert records == [("all_reduce", 2, s, s, s), ("all_gather", 2, 2 * s, s, s)]
        assert seen == [(op, k, [0, 1], shape, "float32", "completed") for k, (op, shape) in enumerate(
            [("all_reduce", [3, 2]), ("all_reduce", [3, 2]), ("reduce_scatter", [6]), ("all_reduce", [3, 2]),
             ("all_gather", [6])], 1)]

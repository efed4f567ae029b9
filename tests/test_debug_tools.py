"""minipar.debug: the desync check (fails before any rank hangs, naming both sides), stragglers from a trace,
the first-departure search against one device, the seeds' rules and RNG state, and the first non-finite operator; and
nothing left running after a planted hang."""
import multiprocessing

import pytest
import torch

from minipar import LaunchTimeout, comm, hooks, launch
from minipar.debug import first_departure, desync, nonfinite, seeds, stragglers
from minipar.machine.trace import Comm, Compute, Mark, RankTrace, Trace
from minipar.rng import megatron_seeds
from conftest import child_pids


# The desync check ---------------------------------------------------------------------------------------

def _shape_mismatch(rank, world_size):
    with desync.desync_check() as check:
        comm.all_reduce(torch.ones(3))
        try:
            comm.all_reduce(torch.ones(4 if rank == 0 else 8))
        except ValueError as exc:
            return str(exc), check.calls
    return None, check.calls


def test_a_shape_mismatch_under_the_desync_check_fails_before_any_rank_hangs_naming_both_shapes(
        no_leftover_processes):
    results = launch(_shape_mismatch, 2, timeout=5, quiet=True)     # a hang: LaunchTimeout after 5 s
    for message, calls in results:                                 # every rank raised, the same words
        assert message == "desync at call #2 on ranks [0, 1]: all_reduce: rank 0 float32[4] vs rank 1 float32[8]"
        assert calls == 2


def _op_and_skip(rank, world_size):
    out = []
    with desync.desync_check():
        try:                                                       # rank 2 calls another op
            if rank == 2:
                comm.all_gather([torch.empty(2) for _ in range(world_size)], torch.ones(2))
            else:
                comm.all_reduce(torch.ones(2))
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_another_op_on_one_rank_is_named_with_the_other_ranks():
    results = launch(_op_and_skip, 4, timeout=30, quiet=True)
    assert results[0] == results[2] == ["desync at call #1 on ranks [0, 1, 2, 3]: ranks 0, 1, 3 all_reduce "
                                        "float32[2] vs rank 2 all_gather float32[2]"]


def _agreeing_calls(rank, world_size):
    with desync.desync_check() as check:
        comm.all_reduce(torch.ones(5, dtype=torch.float64))
        comm.all_gather([torch.empty(3) for _ in range(world_size)], torch.full((3,), float(rank)))
        comm.send(torch.ones(1), (rank + 1) % world_size) if rank == 0 else comm.recv(torch.empty(1), 0)
    assert not [h for h in hooks.active() if isinstance(h, desync.DesyncCheck)]   # the hook is gone after the block
    return check.calls


def test_agreeing_calls_pass_and_sends_are_not_checked():
    assert launch(_agreeing_calls, 2, quiet=True) == [2, 2]


def test_the_fingerprint_and_its_description():
    a = desync.fingerprint(3, "all_reduce", torch.ones(4, 2))
    b = desync.fingerprint(3, "all_reduce", torch.ones(4, 2, dtype=torch.float64))
    assert desync.describe([a, a], [0, 1], 3) is None
    assert desync.describe([a, b], [0, 1], 3) == ("desync at call #3 on ranks [0, 1]: all_reduce: "
                                                  "rank 0 float32[4, 2] vs rank 1 float64[4, 2]")
    skipped = desync.describe([a, desync.fingerprint(4, "all_reduce", torch.ones(4, 2))], [0, 1], 3)
    assert "different calls" in skipped and "rank 1 call #4" in skipped
    uneven = [desync.fingerprint(1, "all_to_all", torch.ones(n)) for n in (2, 5)]
    assert desync.describe(uneven, [0, 1], 1) is None              # uneven all-to-all splits are legitimate


# A planted hang leaves nothing running -------------------------------------------------------------------

def _skip_one(rank, world_size):
    for i in range(5):
        if rank == 2 and i == 2:
            continue
        comm.all_reduce(torch.ones(1024))


def test_nothing_left_running_after_a_planted_hang(no_leftover_processes):
    with pytest.raises(LaunchTimeout) as caught:
        launch(_skip_one, 4, timeout=2, quiet=True)
    assert "rank 2 never issued call #5 (all_reduce" in caught.value.flight
    assert multiprocessing.active_children() == [] and child_pids() == []


# Stragglers ------------------------------------------------------------------------------------------------

_GEMM = {"name": "aten::mm", "kind": "gemm", "flops": 2 * 4096 ** 3, "bytes": 6 * 4096 ** 2, "count": 1}


def _trace(slow_rank=1):
    """Two ranks, 4 marked steps; rank ``slow_rank`` computes 30 ms a step, the other 10 ms and waits 20; each
    segment's counted operators: one 4096³ matmul a rank, three on the slow one."""
    ranks = []
    for r in range(2):
        compute, wait = (0.030, 0.001) if r == slow_rank else (0.010, 0.021)
        ops = [{**_GEMM, "count": 3 if r == slow_rank else 1}]
        events = [Mark("step")]
        for _ in range(4):
            events += [Compute(compute, compute, ops=ops), Comm("all_reduce", (0, 1), 4096, seconds_wall=wait),
                       Mark("step")]
        ranks.append(RankTrace(r, events))
    return Trace(ranks)


def test_the_straggler_is_the_rank_with_most_compute_and_its_cost_is_the_difference():
    found = stragglers.find_straggler(_trace(slow_rank=1))
    assert found.rank == 1 and found.cost == pytest.approx(0.020)
    assert found.others_wait == pytest.approx(0.021) and found.own_wait == pytest.approx(0.001)
    assert "rank 1 is the straggler" in str(found)
    assert stragglers.find_straggler(_trace(slow_rank=0)).rank == 0
    assert stragglers.find_straggler(_trace(), clock="cpu").cost == pytest.approx(0.020)


def test_the_replay_without_the_straggler_is_shorter_by_its_cost():
    from minipar.machine.cluster import h100_cluster, this_machine
    from minipar.machine.device import H100_SXM, Op, op_seconds
    from minipar.machine.replay import replay
    trace = _trace()
    fixed = stragglers.without_straggler(trace, 1)
    assert all(e.seconds_cpu == 0.010 and e.ops[0]["count"] == 1 for e in fixed.ranks[1].events
               if isinstance(e, Compute))
    here = this_machine(1e-5, 1e9, 1e10, devices=2)                     # CPU seconds as they were: scale 1
    as_run, without = (replay(t, here, compute_scale=1.0) for t in (trace, fixed))
    assert min(as_run.step_gaps()) - min(without.step_gaps()) == pytest.approx(0.020, rel=1e-3)
    # on a device card the ops are priced: the straggler costs its two extra matmuls on the H100
    as_run, without = (replay(t, h100_cluster(1)) for t in (trace, fixed))
    two_gemms = op_seconds(Op("mm", "gemm", _GEMM["flops"], _GEMM["bytes"], count=2), H100_SXM)
    assert min(as_run.step_gaps()) - min(without.step_gaps()) == pytest.approx(two_gemms, rel=1e-9)


# The first-departure search ---------------------------------------------------------------------------------------------

def _steps(**changes):
    base = {n: torch.ones(k, dtype=torch.float64) for n, k in (("a.weight", 3), ("a.bias", 1), ("b.weight", 2))}
    return [{n: t.clone() + s for n, t in base.items()} for s in range(3)], changes


def test_first_departure_finds_the_first_step_and_parameter_and_the_boundary():
    reference, _ = _steps()
    rank = [{n: t.clone() for n, t in step.items()} for step in reference]
    assert first_departure.first_departure(reference, [rank], 1e-9).first is None
    rank[1]["a.bias"] += 1e-3                                  # step 1: a.bias and a.weight depart
    rank[1]["a.weight"] += 1e-6
    rank[2]["b.weight"] += 1.0
    found = first_departure.first_departure(reference, [rank, rank], 1e-9)
    assert (found.first.step, found.first.name) == (1, "a.weight")
    assert found.wrong == ["a.weight", "a.bias"] and found.right == ["b.weight"] and found.boundary == "a.bias"
    assert found.first.size == pytest.approx(1e-6 / 2)         # normwise: max |Δ| / max |reference|
    assert first_departure.first_departure(reference, [rank], 1e-5).first.name == "a.bias"   # under a looser tolerance


def test_the_reference_steps_are_one_device_training():
    from minipar.check import mlp_recipe, train_reference
    recipe = mlp_recipe(steps=2)
    steps = first_departure.reference_steps(recipe)
    final = train_reference(recipe).params
    assert len(steps) == 2 and all(torch.equal(steps[-1][n], final[n]) for n in final)


# Seeds and RNG state ----------------------------------------------------------------------------------------

def test_megatron_seeds():
    assert megatron_seeds(1234, tp_rank=3, pp_rank=1) == {"default": 1334, "tensor_parallel": 1334 + 2718 + 3}
    assert megatron_seeds(0, 0, dp_rank=2)["default"] == 0
    assert megatron_seeds(0, 0, dp_rank=2, data_parallel_random_init=True)["default"] == 20


def test_rng_state_restores_every_generator_it_names():
    g = torch.Generator().manual_seed(5)
    state = seeds.rng_state({"g": g})
    first = (torch.rand(3), torch.rand(3, generator=g))
    seeds.set_rng_state(state, {"g": g})
    assert all(torch.equal(a, b) for a, b in zip(first, (torch.rand(3), torch.rand(3, generator=g))))


def _spread(rank, world_size):
    return seeds.replica_spread({"same": torch.ones(3), "mine": torch.full((2,), float(rank))})


def test_replica_spread():
    assert launch(_spread, 2, quiet=True)[0] == {"same": 0.0, "mine": 1.0}


# The first non-finite value ---------------------------------------------------------------------------------

class _Overflow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4).half()

    def forward(self, x):
        z = self.inner(x)
        return (torch.exp(z) / torch.exp(z).sum()).sum()


def test_the_first_non_finite_operator_is_named_with_its_module():
    model = _Overflow()
    with torch.no_grad():
        model.inner.weight.fill_(1.0)
        model.inner.bias.zero_()
    with nonfinite.first_nonfinite(model) as watch:
        model(torch.full((2, 4), 3.0, dtype=torch.float16)).backward()
    found = watch.found
    assert found.op == "exp" and found.output.startswith("inf in float16[2, 4]") and found.largest_input == 12.0
    assert found.module == "_Overflow"
    with nonfinite.first_nonfinite(model) as watch:
        model(torch.full((2, 4), 0.1, dtype=torch.float16))
    assert watch.found is None


def test_no_hook_is_active_by_default():
    assert hooks.active() == ()

"""Chapter 08's layout in PyTorch's own pieces (DeviceMesh, parallelize_module, FSDP2 replicate / fully_shard,
torch.distributed.pipelining: GPipe, 1F1B and Interleaved1F1B with v = 2, loss_parallel) trains like one device
and like minipar's run of the same layout, in float64; DDP over a TP'd model composes when handed the dp sub-mesh and is refused when handed
the dp process group (the message kept here). Equality only: no timing asserted. Each run is 2 Adam steps
(STEPS): the second is the first whose update reads the moments; a third showed nothing more."""
import pytest
import torch

from minipar.check import compare, train_reference
from minipar.course.ch08_hybrid_parallelism import bench, torch_side
from minipar.course.ch08_hybrid_parallelism.measure import recipe
from minipar.hybrid.runner import run
from minipar.launcher import launch

STEPS = 2       # Adam's moments are read from step 2 on: see the docstring
TOL = 1e-10     # float64: the harness's atol (rtol 1e-9); measured differences are ~3e-14


def test_separate_qkv_model_is_the_same_function():
    r = recipe(1)
    ref = r.model().to(r.dtype)
    x, _ = r.batches[0]
    torch.testing.assert_close(torch_side.TorchGPT(ref)(x), ref(x), atol=1e-12, rtol=0)


# The module's three 8-rank PyTorch runs (1F1B, interleaved, fully_shard + GPipe), each its own TorchTrainer3D (own
# mesh, modules, optimizer), one after the other in one launch: the second and third reuse the DTensor sharding
# propagation the first computed (each rank's cache): ~36 s of CPU against ~56 s in a launch each (measured);
# each is still compared with one device, the first two with minipar's run of the layout too.
ON_8 = {"1f1b": dict(dp=2, pp=2, tp=2, micro_batches=4, schedule="1f1b"),
        "interleaved": dict(dp=2, pp=2, tp=2, micro_batches=4, schedule="interleaved", v=2),
        # m = 2: GPipe's order (all F, then all BW) is the same at any m
        "fsdp": dict(dp=2, pp=2, tp=2, micro_batches=2, schedule="gpipe", data_parallel="fsdp")}


def _torch_trainers(rank, world_size, recipe, layouts):
    return [torch_side.torch_train(rank, world_size, recipe, **layout) for layout in layouts.values()]


@pytest.fixture(scope="module")
def torch_on_8() -> dict:
    """{name in ON_8: per-rank RunResults of torch_side.torch_train} (what torch_side.torch_run returns)."""
    per_rank = launch(_torch_trainers, 8, recipe(STEPS), ON_8, quiet=True, timeout=120.0)
    return {name: [runs[i] for runs in per_rank] for i, name in enumerate(ON_8)}


# m = 4 with p = 2: at m = p, the first rank of 1F1B and of the interleaved schedule runs every forward before any
# backward (GPipe's order), so the micro-batch count is part of what these cases test
@pytest.mark.parametrize("dp,pp,tp,m,schedule,v", [(2, 1, 2, 1, "gpipe", 1), (2, 2, 2, 4, "1f1b", 1),
                                                    (2, 2, 2, 4, "interleaved", 2)])
def test_torch_layout_equals_minipar_and_one_device(dp, pp, tp, m, schedule, v, request):
    # interleaved: PyTorch's ScheduleInterleaved1F1B, two stages (one block each) per pp rank, against minipar's
    r, layout = recipe(STEPS), dict(dp=dp, pp=pp, tp=tp, micro_batches=m, schedule=schedule, v=v)
    if dp * pp * tp < 8:        # side_by_side itself: minipar's run, then PyTorch's in a launch of its own
        out = torch_side.side_by_side(r, **layout)
    else:                       # the same comparisons, PyTorch's run taken from the module's one 8-rank launch
        assert {"v": 1, **ON_8[schedule]} == layout
        ours = run(r, world_size=8, **layout)
        out = torch_side.side_by_side_of(r, train_reference(r), ours, request.getfixturevalue("torch_on_8")[schedule])
    for key in ("minipar_vs_one_device", "torch_vs_one_device", "minipar_vs_torch"):
        c = out[key]
        assert c.matches and c.max_abs_diff < TOL, (key, str(c))
    assert out["losses"]["torch"] == pytest.approx(out["losses"]["one device"], abs=TOL)


def test_fully_shard_in_a_pipeline_equals_one_device(torch_on_8):
    r = recipe(STEPS)
    c = compare(train_reference(r), torch_on_8["fsdp"], dtype=r.dtype)     # ON_8["fsdp"]: dp 2 × pp 2 × tp 2, GPipe
    assert c.matches and c.max_abs_diff < TOL, str(c)


def test_ddp_with_the_dp_sub_mesh_over_a_tensor_parallel_model_equals_one_device():
    out = torch_side.ddp_over_tp_with_mesh(recipe(STEPS), dp=2, tp=2)
    assert out["vs_one_device"].matches and out["vs_one_device"].max_abs_diff < TOL, str(out["vs_one_device"])
    assert out["losses"]["torch DDP + TP"] == pytest.approx(out["losses"]["one device"], abs=TOL)


def test_ddp_with_a_process_group_over_a_tensor_parallel_model_is_refused():
    errors = launch(torch_side.ddp_over_tp_error, 4, recipe(1), quiet=True)
    assert all(e and "mixed torch.Tensor and DTensor" in e for e in errors), errors


def test_bench_runs_both_and_their_losses_agree():
    row = bench.run((2, 1, 2), layers=2, embd=32, batch=8, seq=16, iters=1, warmup=1)
    assert row["steps"] == 2 and row["max_loss_diff"] < 2e-5          # float32, same batches, same steps
    assert row["minipar_ms"] > 0 and row["torch_ms"] > 0

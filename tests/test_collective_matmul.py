"""Collective matmul / async TP (minipar.tensor.collective_matmul) against the blocking sequence-parallel
layers and against one device.

Tolerances: against the blocking SP layers run on minipar's rings (``comm.ring_algorithms()``), every output
and gradient is bit-identical when PyTorch's CPU GEMM computes a block of rows as it computes those rows in
the whole: batch 1 (contiguous rows) with at least 4 rows per block, as in the two bit-exact tests. It does not
always: with 2 rows per block (a small-M kernel) or with batch > 1 (the blocking layer multiplies
``all_gather_dim``'s sequence-major view of an (s, b, h) buffer) an element may round differently — seen at
1 ulp in float64 in the GPT's second step. Those cases, gloo's own reduce-scatter (another order of
additions) and one device are compared at 1e-5 in float32 and 1e-12 in float64, and the GPT's 2 Adam steps at
the harness's float64 tolerance.
"""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minipar import launch

QUIET = {"quiet": True}


def _mlp_parts(h, dtype):
    g = torch.Generator().manual_seed(0)
    fc, proj = nn.Linear(h, 4 * h).to(dtype), nn.Linear(4 * h, h).to(dtype)
    with torch.no_grad():
        for p in (*fc.parameters(), *proj.parameters()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) / h ** 0.5)
    return fc, proj


def _mlp_vs_blocking(rank, world_size, dtype=torch.float32, rings=True, keep_gathered=False, b=2, s=8, h=16):
    """One SP TP MLP forward + backward, blocking (TensorParallelMLP) and as collective matmuls
    (use_collective_matmul), and the unsharded MLP on one device: every difference, the bytes each logged,
    and the collective matmul's timeline."""
    from minipar import comm
    from minipar.mesh import Mesh
    from minipar.tensor.collective_matmul import use_collective_matmul
    from minipar.tensor.layers import TensorParallelMLP, keep_gathered_inputs
    from minipar.tensor.operators import all_gather_dim
    from minipar.tensor.sequence import sync_sequence_parallel_grads

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    fc, proj = _mlp_parts(h, dtype)
    g = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(b, s, h, generator=g, dtype=dtype) for _ in range(2))
    shard = lambda t: t.chunk(world_size, dim=1)[rank].clone()  # noqa: E731
    timeline = []
    blocking = TensorParallelMLP(fc, proj, group, sequence_parallel=True)
    decomposed = use_collective_matmul(TensorParallelMLP(fc, proj, group, sequence_parallel=True), timeline)
    runs = {}
    for name, mlp in (("blocking", blocking), ("decomposed", decomposed)):
        keep_gathered_inputs(mlp, keep_gathered)
        xs = shard(x).requires_grad_(True)
        rings_here = comm.ring_algorithms() if rings and name == "blocking" else contextlib.nullcontext()
        with rings_here, comm.recording() as log:
            y = mlp(xs)
            y.backward(shard(dy))
        sync_sequence_parallel_grads([mlp.proj.bias], group)
        grads = {"x": xs.grad, "fc.weight": mlp.fc.weight.grad, "fc.bias": mlp.fc.bias.grad,
                 "proj.weight": mlp.proj.weight.grad, "proj.bias": mlp.proj.bias.grad}
        runs[name] = {"y": y.detach(), **grads, "sent": log.bytes_sent, "received": log.bytes_received,
                      "ops": log.by_op()}
    # one device: the unsharded MLP, and the collective matmul's results gathered whole
    xf = x.clone().requires_grad_(True)
    yf = F.linear(F.gelu(fc(xf)), proj.weight, proj.bias)
    yf.backward(dy)
    mine = runs["decomposed"]
    whole = {"y": all_gather_dim(mine["y"], 1, group), "x": all_gather_dim(mine["x"], 1, group),
             "fc.weight": all_gather_dim(mine["fc.weight"], 0, group),
             "fc.bias": all_gather_dim(mine["fc.bias"], 0, group),
             "proj.weight": all_gather_dim(mine["proj.weight"], 1, group), "proj.bias": mine["proj.bias"]}
    one = {"y": yf, "x": xf.grad, "fc.weight": fc.weight.grad, "fc.bias": fc.bias.grad,
           "proj.weight": proj.weight.grad, "proj.bias": proj.bias.grad}
    names = ("y", "x", "fc.weight", "fc.bias", "proj.weight", "proj.bias")
    return {
        "equal": {k: torch.equal(runs["blocking"][k], mine[k]) for k in names},
        "vs blocking": {k: float((runs["blocking"][k] - mine[k]).abs().max()) for k in names},
        "vs one device": {k: float((whole[k] - one[k]).abs().max()) for k in names},
        "bytes": {n: (r["sent"], r["received"]) for n, r in runs.items()},
        "ops": {n: r["ops"] for n, r in runs.items()},
        "timeline": timeline,
    }


def _mlp_both_keeps(rank, world_size, dtype, rings, **sizes):
    """:func:`_mlp_vs_blocking` without and with the gathered inputs kept, in one launch: {keep: result}."""
    return {keep: _mlp_vs_blocking(rank, world_size, dtype, rings, keep, **sizes) for keep in (False, True)}


@pytest.fixture(scope="module")
def on_gloo():
    """``on_gloo(tp, dtype)``: {keep: [per-rank :func:`_mlp_vs_blocking`]} against gloo's reduce-scatter (rings
    off), b, s, h = 2, 8, 16; one launch per (tp, dtype), made once and shared: the same runs serve the
    tolerance test (tp 4), the bytes test (float32) and the schedule test (tp 4, float32, keep off: its timeline
    is the collective matmul's, which never runs on the rings)."""
    made = {}

    def get(tp, dtype):
        if (tp, dtype) not in made:
            per_rank = launch(_mlp_both_keeps, tp, dtype, False, **QUIET)
            made[(tp, dtype)] = {keep: [r[keep] for r in per_rank] for keep in (False, True)}
        return made[(tp, dtype)]
    return get


@pytest.mark.parametrize("tp", [2, 4])
def test_bit_identical_to_blocking_sp_on_rings_and_equal_to_one_device(tp):
    """float32, batch 1, 16 tokens: outputs, dX and every weight and bias gradient bit-identical to the
    blocking SP MLP on minipar's rings; within 1e-5 of the unsharded MLP."""
    for rank, res in enumerate(launch(_mlp_vs_blocking, tp, torch.float32, True, b=1, s=16, **QUIET)):
        assert all(res["equal"].values()), (rank, res["vs blocking"])
        for what, d in res["vs one device"].items():
            assert d < 1e-5, f"rank {rank}: {what} differs from one device by {d}"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_equal_to_blocking_sp_on_gloo_within_tolerance(on_gloo, dtype, tol):
    """Against gloo's reduce-scatter (its own order of additions): 1e-5 in float32, 1e-12 in float64; and to
    one device the same; with the gathered inputs kept too (no all-gather in backward)."""
    for keep in (False, True):
        for rank, res in enumerate(on_gloo(4, dtype)[keep]):
            for kind in ("vs blocking", "vs one device"):
                for what, d in res[kind].items():
                    assert d < tol, f"rank {rank}, keep={keep}: {what} {kind} by {d}"


@pytest.mark.parametrize("tp", [2, 4])
def test_bytes_equal_the_blocking_versions(on_gloo, tp):
    """Async TP's bytes equal TP's: the log's bytes sent and received by the collective matmul (p−1 sends
    per decomposed collective) equal the blocking SP MLP's all-gathers and reduce-scatters, with and without
    the backward re-gather; and they are the formula's: forward AG + RS, backward (AG) + RS + AG."""
    b, s, h = 2, 8, 16
    act = b * s * h * 4                          # one (b, s, h) float32 activation
    for keep in (False, True):
        for res in on_gloo(tp, torch.float32)[keep]:
            assert res["bytes"]["decomposed"] == res["bytes"]["blocking"], res["ops"]
            collectives = 4 if keep else 5
            assert res["bytes"]["decomposed"][0] == collectives * (tp - 1) / tp * act
            sends = res["ops"]["decomposed"]["send"][0]
            assert sends == (tp - 1) * collectives and set(res["ops"]["decomposed"]) == {"send", "recv"}


def test_every_send_starts_before_the_matmul_of_its_step(on_gloo):
    """The schedule as it ran (time.perf_counter on each rank): in every ring step that has a transfer, the
    send is started before that step's matmul begins and waited after it ends, p−1 transfers and p matmuls
    per ring; in the column layer's backward, the all-gather of X is posted before the dX GEMM (step 0) and
    the reduce-scatter of dX before the dW GEMM (step 1), each waited after its GEMM."""
    tp = 4
    for res in on_gloo(tp, torch.float32)[False]:
        steps = {}
        for phase, event, step, t in res["timeline"]:
            steps.setdefault((phase, step), {})[event] = t
        phases = {phase for phase, _ in steps}
        assert phases == {"all_gather_matmul", "matmul_reduce_scatter", "backward: all-gather + GEMM for dY",
                          "backward: all-gather under dX, reduce-scatter under dW"}
        for (phase, step), t in steps.items():
            if "send_start" in t:
                assert t["send_start"] <= t["matmul_start"] <= t["matmul_end"] <= t["wait_end"], (phase, step)
        for phase in phases - {"backward: all-gather under dX, reduce-scatter under dW"}:
            assert sum("send_start" in t for (ph, _), t in steps.items() if ph == phase) == tp - 1, phase
            assert sum("matmul_start" in t for (ph, _), t in steps.items() if ph == phase) == tp, phase


def _bad_inputs(rank, world_size):
    from minipar.mesh import Mesh
    from minipar.tensor.collective_matmul import CollectiveMatmulColumnLinear, matmul_reduce_scatter
    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    errors = []
    with pytest.raises(ValueError, match="sequence length 6 .* not divisible by the tensor-parallel degree 4"):
        matmul_reduce_scatter(torch.randn(2, 6, 8), torch.randn(8, 8), group)
    errors.append("seq")
    one = Mesh(world_size, tp=1, dp=world_size).build(rank).group("tp")
    with pytest.raises(ValueError, match="at least 2 ranks"):
        CollectiveMatmulColumnLinear(torch.randn(8, 8), None, one)
    errors.append("p=1")
    return errors


def test_bad_input_raises_value_error():
    assert launch(_bad_inputs, 4, **QUIET) == [["seq", "p=1"]] * 4


def _train_sp_gpt(rank, world_size, recipe, collective_matmul):
    """TensorParallelGPT with SP, trained inside comm.ring_algorithms() (blocking collectives on minipar's
    rings), its attention and MLP layers made collective matmuls or not: (RunResult, bytes sent in training,
    how many layers were swapped)."""
    from minipar import comm
    from minipar.check import RunResult
    from minipar.mesh import Mesh
    from minipar.tensor.collective_matmul import (CollectiveMatmulColumnLinear, CollectiveMatmulRowLinear,
                                                  use_collective_matmul)
    from minipar.tensor.gpt import TensorParallelGPT

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    model = TensorParallelGPT(recipe.model().to(recipe.dtype), group, sequence_parallel=True)
    if collective_matmul:
        use_collective_matmul(model)
    swapped = sum(isinstance(m, (CollectiveMatmulColumnLinear, CollectiveMatmulRowLinear)) for m in model.modules())
    opt = recipe.optimizer(model.parameters())
    losses = []
    with comm.ring_algorithms(), comm.recording() as log:
        for inputs, targets in recipe.batches:
            opt.zero_grad(set_to_none=True)
            loss = model.loss(inputs, targets)
            loss.backward()
            model.finish_backward()
            opt.step()
            losses.append(loss.item())
    return RunResult(losses, model.full_state_dict()), log.bytes_sent, swapped


def _train_sp_gpt_both(rank, world_size, recipe):
    """:func:`_train_sp_gpt` blocking, then with collective matmuls, in one launch: (blocking, decomposed)."""
    return tuple(_train_sp_gpt(rank, world_size, recipe, collective_matmul) for collective_matmul in (False, True))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_sp_tp_gpt_with_collective_matmuls_trains_like_blocking_sp_and_one_device(batch_size):
    """The whole SP TP GPT (per block QKV, attention projection, fc and MLP projection swapped, and the
    vocabulary-parallel LM head, a column-parallel layer on the sequence shards too) on 4 ranks, 2 Adam steps
    (Adam's state is used from step 2; 3 showed the same) in float64: the same bytes sent as blocking SP; losses and every parameter bit-identical to blocking SP on
    the rings at batch 1, within the harness's float64 tolerance of it at batch 4; equal to one device at that
    tolerance."""
    from minipar.check import compare, gpt_recipe, train_reference
    recipe = gpt_recipe(steps=2, batch_size=batch_size, seq_len=16, vocab_size=66)
    recipe.dtype = torch.float64
    blocking, decomposed = zip(*launch(_train_sp_gpt_both, 4, recipe, **QUIET))
    for (b_run, b_bytes, b_swapped), (d_run, d_bytes, d_swapped) in zip(blocking, decomposed):
        assert (b_swapped, d_swapped) == (0, 4 * recipe.model().cfg.n_layer + 1)   # + the LM head
        assert d_bytes == b_bytes
        if batch_size == 1:
            assert d_run.losses == b_run.losses
            assert all(torch.equal(d_run.params[n], b_run.params[n]) for n in b_run.params)
    runs = [run for run, _, _ in decomposed]
    compare(blocking[0][0], runs, dtype=recipe.dtype).assert_ok()
    compare(train_reference(recipe), runs, dtype=recipe.dtype).assert_ok()


def _block_bytes(rank, world_size, collective_matmul, keep_gathered):
    from minipar.models import GPTConfig
    from minipar.tensor.collective_matmul import use_collective_matmul
    from minipar.tensor.layers import keep_gathered_inputs
    from minipar.tensor.measure import measure_layer

    def prepare(block):
        keep_gathered_inputs(block, keep_gathered)
        if collective_matmul:
            use_collective_matmul(block)
    res = measure_layer(rank, world_size, GPTConfig(n_embd=32, n_head=4), 2, 16, True, prepare=prepare)
    return res["bytes_sent"], res["by_op"]


@pytest.mark.parametrize("keep_gathered", [False, True])
def test_a_transformer_blocks_bytes_are_sps(keep_gathered):
    """One SP transformer block (minipar.tensor.measure) with its four linears as collective matmuls sends
    exactly sequence parallelism's bytes per layer, sp_bytes_per_layer (= TP's 4 all-reduces, plus the 2
    backward re-gathers unless the gathered inputs are kept), all as point-to-point sends."""
    from minipar.tensor.sequence import sp_bytes_per_layer
    tp, b, s, h = 4, 2, 16, 32
    for sent, by_op in launch(_block_bytes, tp, True, keep_gathered, **QUIET):
        assert sent == sp_bytes_per_layer(s, b, h, tp, regather=not keep_gathered)
        assert set(by_op) == {"send", "recv"}
        assert by_op["send"][0] == (tp - 1) * (8 + (0 if keep_gathered else 2))

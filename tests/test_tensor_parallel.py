"""Megatron tensor parallelism (minipar.tensor) against one device and against PyTorch's DTensor TP.

Tolerances: the GPT runs train in float64 with Adam and use the harness's float64 tolerance
(atol 1e-10, rtol 1e-9): the only difference from one device is the order of summation in the
all-reduces. (In float32, Adam turns rounding noise on near-zero gradients into updates of up to lr, so
float32 runs are checked with SGD, at the harness's float32 tolerance.) The layer tests compare forward
outputs and gradients at 1e-6 (float32, a handful of sums reordered).
"""
import types

import pytest
import torch
import torch.nn as nn

from minipar.check import gpt_recipe
from minipar import launch
from minipar.models import MLP, GPTConfig
from minipar.tensor import gpt as tp_gpt
from minipar.tensor.gpt import compare_to_one_device, validate
from minipar.tensor.measure import measure_layer
from minipar.activations import activation_bytes_formula
from minipar.tensor.sequence import tp_bytes_per_layer, uncounted_bytes

QUIET = {"quiet": True}


def _recipe(dtype=torch.float64, optimizer="adam", **cfg):
    # 2 steps: Adam's state (and SGD's step-2 gradient at updated weights) is used from step 2
    recipe = gpt_recipe(steps=2, batch_size=4, seq_len=16, optimizer=optimizer, vocab_size=66, **cfg)
    recipe.dtype = dtype      # vocabulary 66: padded to 68 at TP=4
    return recipe


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_gpt_trains_like_one_device(tp):
    """Loss at each of 2 Adam steps and every parameter after them equal one device (float64), with label
    smoothing 0.1 (same loss and gradients for every TP degree)."""
    compare_to_one_device(_recipe(), world_size=tp, label_smoothing=0.1, launch_kwargs=QUIET).assert_ok()


def test_tp_gpt_float32_sgd_and_tied_weights():
    """float32 (harness tolerance atol 2e-5, rtol 1e-4) with SGD, no label smoothing, and a tied embedding /
    LM head."""
    compare_to_one_device(_recipe(torch.float32, "sgd", tie_weights=True), world_size=4, launch_kwargs=QUIET).assert_ok()


def test_a_wrong_shard_is_caught():
    """The harness is not blind: a TP model whose fc shard is cut from the wrong columns fails."""
    original = tp_gpt.TensorParallelGPT.__init__

    def broken_init(self, ref, group, *args, **kwargs):
        with torch.no_grad():   # swap two output features of the first MLP before sharding
            w = ref.blocks[0].mlp.fc.weight
            w[[0, -1]] = w[[-1, 0]]
        original(self, ref, group, *args, **kwargs)

    tp_gpt.TensorParallelGPT.__init__ = broken_init
    try:
        comparison = compare_to_one_device(_recipe(), world_size=2, launch_kwargs=QUIET)
    finally:
        tp_gpt.TensorParallelGPT.__init__ = original
    assert not comparison.matches


def test_bad_degrees_raise_before_any_process(monkeypatch):
    monkeypatch.setattr(tp_gpt, "check_equivalence", lambda *a, **k: pytest.fail("launched anyway"))
    with pytest.raises(ValueError, match="n_head .* not divisible by the tensor-parallel degree 4"):
        compare_to_one_device(gpt_recipe(steps=1, n_head=6, n_embd=48), world_size=4)
    fake = types.SimpleNamespace(n_head=4, n_embd=30, ffn_hidden=128)
    with pytest.raises(ValueError, match="n_embd .* = 30 is not divisible"):
        validate(fake, tp=4)
    fake = types.SimpleNamespace(n_head=4, n_embd=32, ffn_hidden=102)
    with pytest.raises(ValueError, match="ffn_hidden .* = 102 is not divisible"):
        validate(fake, tp=4)
    with pytest.raises(ValueError, match="positive integer"):
        validate(GPTConfig(), tp=0)


def _layers_vs_full(rank, world_size):
    """ColumnParallelLinear (gathered output) and RowParallelLinear (input split inside) vs nn.Linear."""
    from minipar.mesh import Mesh
    from minipar.tensor.layers import ColumnParallelLinear, RowParallelLinear
    from minipar.tensor.operators import all_gather_dim

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    full = nn.Linear(8, 12)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        full.weight.copy_(torch.randn(12, 8, generator=g))
        full.bias.copy_(torch.randn(12, generator=g))
    x = torch.randn(3, 8, generator=g)
    col = ColumnParallelLinear.from_linear(full, group, gather_output=True)
    row = RowParallelLinear.from_linear(full, group, input_is_parallel=False)
    xc, xr, xf = (x.clone().requires_grad_(True) for _ in range(3))
    ycol, yrow, yfull = col(xc), row(xr), full(xf)
    for y in (ycol, yrow, yfull):
        y.pow(2).sum().backward()
    diffs = {
        "column out": (ycol - yfull).abs().max(), "row out": (yrow - yfull).abs().max(),
        "column dX": (xc.grad - xf.grad).abs().max(), "row dX": (xr.grad - xf.grad).abs().max(),
        "column dW": (all_gather_dim(col.weight.grad, 0, group) - full.weight.grad).abs().max(),
        "column db": (all_gather_dim(col.bias.grad, 0, group) - full.bias.grad).abs().max(),
        "row dW": (all_gather_dim(row.weight.grad, 1, group) - full.weight.grad).abs().max(),
        "row db": (row.bias.grad - full.bias.grad).abs().max(),
    }
    return {k: float(v) for k, v in diffs.items()}


# ----------------------------------------------------------------------------------------------------
# The operators (minipar.tensor.operators): forward and backward equal to the unsplit computation, and
# the one collective each direction logs
# ----------------------------------------------------------------------------------------------------

def _operators_vs_unsplit(rank, world_size, rings=False):
    """Every operator on float64 (2, 8, 4) tensors: (forward, gradient, forward ops, backward ops) here,
    and what the unsplit computation gives (every rank's inputs are drawn from the same seeds); with
    ``rings``, inside ``comm.ring_algorithms()``."""
    import contextlib
    from minipar import comm
    from minipar.mesh import Mesh
    from minipar.tensor import operators as ops

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    draw = lambda r, *shape: torch.randn(*shape, generator=torch.Generator().manual_seed(r), dtype=torch.float64)  # noqa: E731
    x, shard = draw(99, 2, 8, 4), lambda t, dim: t.chunk(world_size, dim)[rank]  # noqa: E731
    per_rank = [draw(r, 2, 8, 4) for r in range(world_size)]        # partial sums / rank-specific gradients
    total = sum(per_rank)
    cases = {   # name: (operator, input, upstream gradient, expected output, expected input gradient)
        "f copy_to_tp": (ops.copy_to_tp, x, per_rank[rank], x, total),
        "g reduce_from_tp": (ops.reduce_from_tp, per_rank[rank], x, total, x),
        "split_to_tp": (ops.split_to_tp, x, shard(per_rank[rank], -1), shard(x, -1),
                        torch.cat([p.chunk(world_size, -1)[r] for r, p in enumerate(per_rank)], -1)),
        "gather_from_tp": (ops.gather_from_tp, shard(x, -1), x, x, shard(x, -1)),
        "g gather_sequence": (ops.gather_sequence, shard(x, 1), per_rank[rank], x, shard(total, 1)),
        "g-bar scatter_sequence": (ops.scatter_sequence, per_rank[rank], shard(x, 1), shard(total, 1), x),
    }
    out = {}
    for name, (op, inp, dy, want_y, want_dx) in cases.items():
        inp = inp.clone().requires_grad_(True)
        with comm.ring_algorithms() if rings else contextlib.nullcontext():
            with comm.recording() as fwd:
                y = op(inp, group)
            with comm.recording() as bwd:
                y.backward(dy)
        out[name] = (float((y - want_y).abs().max()), float((inp.grad - want_dx).abs().max()),
                     [r.op for r in fwd.records], [r.op for r in bwd.records])
    return out


@pytest.mark.parametrize("rings", [False, True])
def test_operators_equal_the_unsplit_computation_and_log_their_collective(rings):
    """f/g (Shoeybi 2019; Korthikanti's f/f̄) and g/ḡ (Korthikanti 2022) at float64, exactly: each moves
    only what a sum, a concatenation or a slice moves (atol 1e-12 for the reordered sums). Inside
    comm.ring_algorithms() the same operators run on minipar's send/recv rings."""
    colls = {"f copy_to_tp": ([], ["all_reduce"]), "g reduce_from_tp": (["all_reduce"], []),
             "split_to_tp": ([], ["all_gather"]), "gather_from_tp": (["all_gather"], []),
             "g gather_sequence": (["all_gather"], ["reduce_scatter"]),
             "g-bar scatter_sequence": (["reduce_scatter"], ["all_gather"])}
    for per_op in launch(_operators_vs_unsplit, 4, rings, **QUIET):
        for name, (dy, dx, fwd, bwd) in per_op.items():
            assert dy < 1e-12 and dx < 1e-12, (name, dy, dx)
            if rings:   # every collective became the ring's messages: (N-1) sends per all-gather/RS, 2(N-1) per AR
                want = [["send", "recv"] * (3 * (op == "all_reduce") + 3) for op in colls[name][0]], \
                       [["send", "recv"] * (3 * (op == "all_reduce") + 3) for op in colls[name][1]]
                assert (fwd, bwd) == tuple(sum(w, []) for w in want), name
            else:
                assert (fwd, bwd) == colls[name], name


def test_operator_source_shows_its_collective():
    """Issue 24: inspect.getsource of Megatron's f and g shows the all-reduce, not a string table."""
    import inspect
    from minipar.tensor import operators as ops
    assert "comm.all_reduce" in inspect.getsource(ops.CopyToTensorParallel.backward)
    assert "comm.all_reduce" in inspect.getsource(ops.ReduceFromTensorParallel.forward)
    assert "CopyToTensorParallel.apply(x, group)" in inspect.getsource(ops.copy_to_tp)
    assert not hasattr(ops, "split_sequence") and not hasattr(ops, "_ConjugatePair")


@pytest.mark.parametrize("tp", [4])
def test_column_and_row_parallel_linear_forward_backward(tp):
    for rank, diffs in enumerate(launch(_layers_vs_full, tp, **QUIET)):
        for what, d in diffs.items():
            assert d < 1e-5, f"rank {rank}: {what} differs by {d}"


def _mine_vs_dtensor(rank, world_size, sequence_parallel):
    """The same MLP, tensor-parallel by minipar and by torch.distributed.tensor.parallel."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from minipar.mesh import Mesh
    from minipar.tensor.layers import TensorParallelMLP
    from minipar.tensor.sequence import sync_sequence_parallel_grads

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    ref, theirs = MLP((16, 64, 16), seed=0), MLP((16, 64, 16), seed=0)
    mine = TensorParallelMLP(ref.layers[0], ref.layers[1], group, sequence_parallel=sequence_parallel)
    if sequence_parallel:   # PyTorch's SP for the same layers: sequence-sharded in and out
        plan = {"layers.0": ColwiseParallel(input_layouts=Shard(1)),
                "layers.1": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()}
    parallelize_module(theirs, DeviceMesh.from_group(group, "cpu"), plan)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    if sequence_parallel:
        x = x.chunk(world_size, dim=1)[rank].clone()
    y_mine, y_theirs = mine(x), theirs(x)
    y_mine.pow(2).sum().backward()
    y_theirs.pow(2).sum().backward()
    if sequence_parallel:   # the bias was added to a sequence shard: its gradient is summed over the group
        sync_sequence_parallel_grads([mine.proj.bias], group)
    return {
        "output": float((y_mine - y_theirs).abs().max()),
        "fc.weight grad": float((mine.fc.weight.grad - theirs.layers[0].weight.grad.to_local()).abs().max()),
        "fc.bias grad": float((mine.fc.bias.grad - theirs.layers[0].bias.grad.to_local()).abs().max()),
        "proj.weight grad": float((mine.proj.weight.grad - theirs.layers[1].weight.grad.to_local()).abs().max()),
        "proj.bias grad": float((mine.proj.bias.grad - theirs.layers[1].bias.grad.full_tensor()).abs().max()),
    }


def _mine_vs_dtensor_both(rank, world_size):
    return {sp: _mine_vs_dtensor(rank, world_size, sp) for sp in (False, True)}


@pytest.fixture(scope="module")
def mine_vs_dtensor():
    """{sequence_parallel: per-rank diffs}: both plans in one launch of 4 ranks (each rank imports DTensor's
    parallel API once, not once per plan)."""
    per_rank = launch(_mine_vs_dtensor_both, 4, **QUIET)
    return {sp: [r[sp] for r in per_rank] for sp in (False, True)}


@pytest.mark.parametrize("tp,sequence_parallel", [(4, False), (4, True)])
def test_mlp_equals_pytorch_dtensor_tp(mine_vs_dtensor, tp, sequence_parallel):
    """Outputs and every gradient equal PyTorch's ColwiseParallel/RowwiseParallel (float32, 1e-6)."""
    assert len(mine_vs_dtensor[sequence_parallel]) == tp
    for rank, diffs in enumerate(mine_vs_dtensor[sequence_parallel]):
        for what, d in diffs.items():
            assert d < 1e-6, f"rank {rank}: {what} differs from DTensor by {d}"


def layer_costs(rank, world_size, sequence_parallel, b=2, s=16, h=32, a=4):
    """One transformer block's bytes and saved activations on this rank, without and with dropout."""
    return {p: measure_layer(rank, world_size, GPTConfig(n_embd=h, n_head=a, dropout=p), b, s, sequence_parallel)
            for p in (0.0, 0.1)}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bytes_and_activation_memory_per_layer(tp):
    """Bytes, from the comm log: exactly 4 all-reduces of b·s·h float32 per layer per step.
    Activations: measured saved bytes of one block = sbh(10 + 24/t + 5as/(ht)) (Korthikanti et al. 2022)
    scaled to float32 values and 1-byte masks, plus LayerNorm statistics and the causal mask, exactly."""
    b, s, h, a = 2, 16, 32, 4
    for rank, by_dropout in enumerate(launch(layer_costs, tp, False, **QUIET)):
        for p, res in by_dropout.items():
            assert res["by_op"] == {"all_reduce": (4, res["bytes_sent"])}
            assert res["bytes_sent"] == tp_bytes_per_layer(s, b, h, tp) == 4 * 2 * (tp - 1) / tp * b * s * h * 4
            formula = activation_bytes_formula(s, b, h, a, t=tp, value_bytes=4, dropout=p > 0)
            assert res["activation_bytes"] == formula + uncounted_bytes(s, b), (rank, p, res, formula)


def _dropout_replicas(rank, world_size, sequence_parallel):
    """Train 2 steps with dropout 0.2; return what must agree across the group and the two streams' draws."""
    from minipar.mesh import Mesh
    from minipar.tensor.gpt import TensorParallelGPT
    from minipar.rng import DropoutStreams

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    recipe = gpt_recipe(steps=2, batch_size=4, seq_len=16, dropout=0.2)
    model = TensorParallelGPT(recipe.model(), group, sequence_parallel, seed=0)
    opt = recipe.optimizer(model.parameters())
    losses = []
    for x, y in recipe.batches:
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        model.finish_backward()
        opt.step()
        losses.append(loss.item())
    streams = DropoutStreams(0, group)
    draws = (torch.rand(8, generator=streams.replicated), torch.rand(8, generator=streams.per_rank))
    replicated = {n: p.detach() for n, p in model.named_parameters() if "ln" in n or "pos_emb" in n}
    return losses, replicated, draws


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_streams_agree_and_differ_where_they_must(sequence_parallel):
    """With dropout > 0 the replicated parameters stay bit-identical on every rank after optimizer steps
    (masks of replicated tensors agree), the replicated stream agrees and the per-rank stream differs."""
    results = launch(_dropout_replicas, 2, sequence_parallel, **QUIET)
    (l0, p0, d0), (l1, p1, d1) = results
    assert l0 == l1
    for name in p0:
        assert torch.equal(p0[name], p1[name]), name
    assert torch.equal(d0[0], d1[0])
    assert not torch.equal(d0[1], d1[1])


def _seams_on_tp(rank, world_size):
    """The TP model through the reference's seams: the positions its SP rank holds, and a replaced core
    reaching every tensor-parallel attention layer (its local heads)."""
    from minipar.mesh import Mesh
    from minipar.models import TinyGPT, attention_core, causal_attention
    from minipar.tensor.gpt import TensorParallelGPT

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    ref = TinyGPT(GPTConfig(n_layer=2), seed=0)
    idx = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    held = TensorParallelGPT(ref, group, sequence_parallel=True).positions_held(idx)
    model = TensorParallelGPT(ref, group)
    want, shapes = model(idx), []

    def counting(q, k, v):
        shapes.append(tuple(q.shape))
        return causal_attention(q, k, v)

    with attention_core(model, counting):
        got = model(idx)
    return held.tolist(), shapes, torch.equal(got, want), model.blocks[1].attn.local_heads


def test_tp_plugs_into_the_embedding_and_attention_seams():
    results = launch(_seams_on_tp, 2, **QUIET)
    for rank, (held, shapes, same, heads) in enumerate(results):
        assert held == list(range(8 * rank, 8 * rank + 8))         # SP: this rank's half of 0..15
        assert shapes == [(2, 2, 16, 8)] * 2 and same and heads == 2   # 4 heads / tp=2, whole sequence


def _sum_over_one_and_two(rank, world_size):
    import torch.distributed as dist
    from minipar import comm
    from minipar.tensor.operators import all_reduce_sum
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    x = torch.full((3,), float(rank + 1))
    with comm.recording() as log:
        solo = all_reduce_sum(x, alone)
    calls_alone = log.count()
    with comm.recording() as log:
        both = all_reduce_sum(x, None)
    return solo.tolist(), calls_alone, both.tolist(), log.count()


def test_all_reduce_sum_makes_no_call_on_a_group_of_one():
    """Megatron's ``_reduce`` bypass: a one-rank group returns its input and logs no call; two ranks sum."""
    for rank, (solo, calls_alone, both, calls_both) in enumerate(launch(_sum_over_one_and_two, 2, **QUIET)):
        assert (solo, calls_alone) == ([rank + 1.0] * 3, 0)
        assert (both, calls_both) == ([3.0] * 3, 1)

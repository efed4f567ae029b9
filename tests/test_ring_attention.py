"""Causal ring attention (contiguous and zig-zag) equals dense causal attention: output, dQ, dK, dV."""
import functools
import math

import pytest
import torch

from minipar import comm
from minipar import wire
from minipar.launcher import launch
from minipar.sequence import ring_attention as ra
from minipar.sequence.measure import measured_core, ring_pairs

B, H, S, D = 2, 3, 16, 4
FRAMING = 192   # bytes per send/recv pair gloo may add on the wire: its header + the receiver's ready notice


def dense_causal(q, k, v):
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    t = s.shape[-1]
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return s.softmax(-1) @ v


def problem(seed=0, dtype=torch.float64, s=S):
    g = torch.Generator().manual_seed(seed)
    q, k, v, g_out = (torch.randn(B, H, s, D, generator=g, dtype=dtype) for _ in range(4))
    return q, k, v, g_out


def reference(seed=0):
    q, k, v, g_out = (t.clone() for t in problem(seed))
    for t in (q, k, v):
        t.requires_grad_(True)
    out = dense_causal(q, k, v)
    out.backward(g_out)
    return out.detach(), q.grad, k.grad, v.grad


def _rank(rank, world_size, zigzag):
    q, k, v, g_out = problem()
    shard = lambda t: ra.shard_sequence(t, rank, world_size, zigzag).requires_grad_(True)  # noqa: E731
    q, k, v = shard(q), shard(k), shard(v)
    calls = []
    with comm.recording() as fwd:
        out = measured_core(functools.partial(ra.ring_attention, zigzag=zigzag), calls)(q, k, v)
    with comm.recording() as bwd:
        out.backward(ra.shard_sequence(g_out, rank, world_size, zigzag))
    return (out.detach(), q.grad, k.grad, v.grad, fwd.bytes_sent, fwd.observed_bytes_sent, fwd.count("send"),
            bwd.bytes_sent, bwd.observed_bytes_sent, bwd.count("send"), calls[0][1] // 2)


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("n", [2, 4])
def test_ring_attention_equals_dense_forward_and_backward(n, zigzag):
    want = reference()
    results = launch(_rank, n, zigzag, quiet=True)
    for i, name in enumerate(["out", "dQ", "dK", "dV"]):
        got = ra.unshard_sequence([r[i] for r in results], zigzag)
        assert torch.allclose(got, want[i], atol=1e-12, rtol=1e-10), (name, float((got - want[i]).abs().max()))
    elem = B * (S // n) * H * D * 8
    for r in results:
        assert r[4] == ra.forward_bytes(B, S, H * D, n, 8) == 2 * (n - 1) * elem
        assert r[7] == ra.backward_bytes(B, S, H * D, n, 8)
        if wire.available():   # the wire: the model plus gloo's framing per message (144 B seen here)
            assert r[4] <= r[5] <= r[4] + FRAMING * r[6]
            assert r[7] <= r[8] <= r[7] + FRAMING * r[9]
    blocks = [r[10] for r in results]       # measured beside the ring: its matrix products / 2
    # chunk pairs computed: contiguous r+1 (unbalanced), zig-zag 2N+1 on every rank
    assert blocks == ([2 * n + 1] * n if zigzag else [r + 1 for r in range(n)])
    assert blocks == [ring_pairs(r, n, zigzag) for r in range(n)]        # = what the schedule says


def test_lse_merge_is_exact_and_stable():
    q, k, v, _ = problem()
    full_o, full_lse = ra.block_attention(q, k, v)
    a = ra.block_attention(q, k[..., :5, :], v[..., :5, :])
    b = ra.block_attention(q, k[..., 5:, :], v[..., 5:, :])
    o, lse = ra.lse_merge(*a, *b)
    assert torch.allclose(o, full_o, atol=1e-12) and torch.allclose(lse, full_lse, atol=1e-12)
    big = [t * 1e3 for t in (q, k)]          # scores near 1e6: exp would overflow, the merge does not
    o, lse = ra.lse_merge(*ra.block_attention(big[0], big[1][..., :5, :], v[..., :5, :]),
                          *ra.block_attention(big[0], big[1][..., 5:, :], v[..., 5:, :]))
    assert torch.isfinite(o).all() and torch.allclose(o, ra.block_attention(big[0], big[1], v)[0], atol=1e-9)


def test_zigzag_layout():
    assert ra.chunk_ids(0, 4, True) == [0, 7] and ra.chunk_ids(3, 4, True) == [3, 4]
    assert ra.positions(16, 1, 4, True).tolist() == [2, 3, 12, 13]
    x = torch.arange(16.0).view(1, 16, 1)
    assert torch.equal(ra.unshard_sequence([ra.shard_sequence(x, r, 4, True) for r in range(4)], True), x)


def test_indivisible_sequence_refused():
    with pytest.raises(ValueError, match="2N = 8"):
        ra.validate_sequence(12, 4, zigzag=True)
    with pytest.raises(ValueError, match="divisible by 4"):
        ra.validate_sequence(10, 4)
    ra.validate_sequence(12, 4)


def _vs_torch(rank, world_size, zigzag):
    import torch.distributed as dist
    from minipar.sequence.torch_ref import torch_ring_attention
    group = dist.new_group(list(range(world_size)))
    q, k, v, _ = problem(dtype=torch.float32, s=32)
    q, k, v = (ra.shard_sequence(t, rank, world_size, zigzag) for t in (q, k, v))
    theirs = torch_ring_attention(q, k, v, group, zigzag)
    mine = ra.ring_attention(q, k, v, group, zigzag)
    return float((theirs - mine).abs().max())


@pytest.mark.parametrize("zigzag", [False, True])
def test_equals_pytorchs_own_ring_attention(zigzag):
    pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._attention")
    assert max(launch(_vs_torch, 4, zigzag, quiet=True)) < 1e-5   # float32, different summation order


def _layer(rank, world_size, method):
    from minipar.models import GPTConfig
    from minipar.sequence.measure import layer_on_rank
    return layer_on_rank(rank, world_size, method, 1, 32, GPTConfig(n_embd=16, n_head=2))


@pytest.mark.parametrize("method", ["ring", "ring-zigzag"])
def test_layer_measurement_beside_the_ring(method):
    """Chapter 06b's load-balance numbers, measured outside the strategy (sequence/measure.py): the blocks
    each rank computed (its matrix products / 2) equal the schedule's count, and each rank's attention
    forward took CPU time."""
    per_rank = launch(_layer, 4, method, quiet=True)
    zigzag = method == "ring-zigzag"
    assert [r["attention_blocks"] for r in per_rank] == [ring_pairs(r, 4, zigzag) for r in range(4)]
    assert [r["attention_blocks"] for r in per_rank] == ([9] * 4 if zigzag else [1, 2, 3, 4])
    assert all(0 < r["attention_compute_s"] <= r["forward_cpu_s"] for r in per_rank)

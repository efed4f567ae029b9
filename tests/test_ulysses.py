"""DeepSpeed-Ulysses equals dense causal attention (output, dQ, dK, dV) at N = 2 and 4; bytes observed."""
import pytest
import torch

from minipar import comm
from minipar import wire
from minipar.launcher import launch
from minipar.sequence import ulysses
from minipar.sequence.ring_attention import shard_sequence, unshard_sequence

B, H, S, D = 2, 4, 16, 3


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(4)]


def _rank(rank, world_size):
    q, k, v, g_out = problem()
    q, k, v = (shard_sequence(t, rank, world_size).requires_grad_(True) for t in (q, k, v))
    with comm.recording() as fwd:
        out = ulysses.ulysses_attention(q, k, v)
    with comm.recording() as bwd:
        out.backward(shard_sequence(g_out, rank, world_size))
    return out.detach(), q.grad, k.grad, v.grad, fwd.bytes_sent, fwd.observed_bytes_sent, bwd.bytes_sent, \
        bwd.observed_bytes_sent, fwd.count("all_to_all")


@pytest.mark.parametrize("n", [2, 4])
def test_ulysses_equals_dense(n):
    q, k, v, g_out = (t.requires_grad_(True) for t in problem())
    out = ulysses.dense_causal_attention(q, k, v)
    out.backward(g_out)
    want = [out.detach(), q.grad, k.grad, v.grad]
    results = launch(_rank, n, quiet=True)
    for i in range(4):
        got = unshard_sequence([r[i] for r in results])
        assert torch.allclose(got, want[i], atol=1e-12, rtol=1e-10)
    for r in results:
        assert r[8] == 4
        assert r[4] == r[6] == pytest.approx(ulysses.forward_bytes(B, S, H * D, n, 8))
        if wire.available():
            # gloo's all-to-all: the model's bytes plus its framing, a few hundred bytes per call
            assert r[4] <= r[5] <= r[4] + 4 * (n - 1) * 192
            assert r[6] <= r[7] <= r[6] + 4 * (n - 1) * 192


def test_heads_not_divisible_refused():
    with pytest.raises(ValueError, match="not divisible by N = 4"):
        ulysses.validate_heads(6, 4)


def test_ulysses_volume_falls_with_n_megatron_does_not():
    b, s, h = 1, 4096, 1024
    assert ulysses.forward_bytes(b, s, h, 8) * 8 == pytest.approx(ulysses.megatron_sp_forward_bytes(b, s, h, 8))

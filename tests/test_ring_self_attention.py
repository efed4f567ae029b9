"""Ring self-attention (Colossal-AI) equals dense attention, and its gradient scaling, derived in the
module docstring, is tested against one device: the 1/N goes on the loss (or the gradient average) once."""
import pytest
import torch
import torch.distributed as dist

from minipar import comm
from minipar.launcher import launch
from minipar.sequence import ring_self_attention as rsa
from minipar.sequence.ring_attention import shard_sequence, unshard_sequence
from minipar.sequence.ulysses import dense_causal_attention

B, H, S, D = 2, 2, 16, 4
C = H * D


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(4)]


def _rank(rank, world_size):
    q, k, v, g_out = problem()
    q, k, v = (shard_sequence(t, rank, world_size).requires_grad_(True) for t in (q, k, v))
    with comm.recording() as fwd:
        out = rsa.ring_self_attention(q, k, v)
    with comm.recording() as bwd:
        out.backward(shard_sequence(g_out, rank, world_size))
    return out.detach(), q.grad, k.grad, v.grad, fwd.bytes_sent, bwd.bytes_sent


@pytest.mark.parametrize("n", [2, 4])
def test_ring_self_attention_equals_dense(n):
    q, k, v, g_out = (t.requires_grad_(True) for t in problem())
    out = dense_causal_attention(q, k, v)
    out.backward(g_out)
    want = [out.detach(), q.grad, k.grad, v.grad]
    results = launch(_rank, n, quiet=True)
    for i in range(4):
        assert torch.allclose(unshard_sequence([r[i] for r in results]), want[i], atol=1e-12, rtol=1e-10)
    for r in results:
        assert r[4] == rsa.forward_bytes(B, S, C, n, 8) and r[5] == rsa.backward_bytes(B, S, C, n, 8)


# ---- the gradient scaling: replicated projections W_q, W_k, W_v feed every rank's shard ----

def weights_and_data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, S, C, generator=g, dtype=torch.float64)
    target = torch.randn(B, S, C, generator=g, dtype=torch.float64)
    w = [torch.randn(C, C, generator=g, dtype=torch.float64) / C ** 0.5 for _ in range(3)]
    return x, target, w


def _heads(t):
    return t.view(t.shape[0], t.shape[1], H, D).transpose(1, 2)


def layer_loss(x, target, w, attend):
    """Mean over the tokens present of ((attention output) · target)."""
    q, k, v = (_heads(x @ w_i) for w_i in w)
    out = attend(q, k, v).transpose(1, 2).reshape(x.shape)
    return (out * target).sum(-1).mean()


def _scaled_rank(rank, world_size, divide_dk_by_n):
    x, target, w = weights_and_data()
    w = [w_i.clone().requires_grad_(True) for w_i in w]
    x_r, t_r = (shard_sequence(t, rank, world_size, dim=1) for t in (x, target))

    def attend(q, k, v):
        if divide_dk_by_n:     # the easy mistake: scale the ring's dK (and dV) by 1/N too
            k.register_hook(lambda g: g / world_size)
            v.register_hook(lambda g: g / world_size)
        return rsa.ring_self_attention(q, k, v)

    layer_loss(x_r, t_r, w, attend).backward()        # L_r: the mean over MY tokens
    grads = torch.stack([w_i.grad for w_i in w])
    comm.all_reduce(grads)                             # Σ_r ∂L_r/∂W = N · ∂L/∂W ...
    dist.barrier()
    return grads / world_size                          # ... so average: the 1/N, once


def test_gradient_scaling_one_over_n_once():
    x, target, w = weights_and_data()
    w = [w_i.clone().requires_grad_(True) for w_i in w]
    layer_loss(x, target, w, dense_causal_attention).backward()
    want = torch.stack([w_i.grad for w_i in w])
    for got in launch(_scaled_rank, 4, False, quiet=True):
        assert torch.allclose(got, want, atol=1e-12, rtol=1e-10)
    wrong = launch(_scaled_rank, 4, True, quiet=True)[0]
    assert torch.allclose(wrong[0], want[0], atol=1e-12)            # W_q does not see the extra 1/N ...
    assert not torch.allclose(wrong[1], want[1], rtol=0.1)          # ... W_k and W_v do: wrong
    assert not torch.allclose(wrong[2], want[2], rtol=0.1)

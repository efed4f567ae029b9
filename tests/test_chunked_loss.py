"""Chunked cross-entropy (minipar.sequence.chunked_loss) equals F.cross_entropy of the full logits — loss,
dH and dW, float32 and float64, with ignored tokens, a vocabulary that is not a multiple of the chunk — and
its peak memory, measured, is below the plain loss's."""
import pytest
import torch
import torch.nn.functional as F

from minipar.memory import LiveTensorTracker
from minipar.sequence.chunked_loss import chunked_cross_entropy

TOL = {torch.float64: dict(atol=1e-12, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-4)}


def problem(tokens, d, vocab, dtype, seed=0, ignore=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, d, generator=g, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(vocab, d, generator=g, dtype=dtype) * 0.5).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[:ignore] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("vocab,chunk,ignore", [(1000, 128, 0), (1000, 1000, 3), (257, 64, 5), (50, 7, 0)])
def test_equals_cross_entropy(vocab, chunk, ignore, reduction, dtype):
    hidden, weight, targets = problem(24, 16, vocab, dtype, ignore=ignore)
    got = chunked_cross_entropy(hidden, weight, targets, chunk, reduction)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    want = F.cross_entropy(hidden @ weight.T, targets, reduction=reduction)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    for name, a, b in [("loss", got, want), *zip(("dH", "dW"), got_grads, want_grads)]:
        assert torch.allclose(a, b, **TOL[dtype]), (name, float((a - b).abs().max()))


def _peak(loss_fn, tokens=256, d=32, vocab=8192):
    hidden, weight, targets = problem(tokens, d, vocab, torch.float32)
    tracker = LiveTensorTracker()
    with tracker:
        loss_fn(hidden, weight, targets).backward()
    return tracker.peak


def test_peak_memory_below_the_plain_loss():
    """Measured, forward + backward: the plain loss holds tokens × V logits (and their gradient); chunked, a
    tokens × chunk block, plus dH and dW, which both make."""
    tokens, d, vocab, chunk = 256, 32, 8192, 512
    plain = _peak(lambda h, w, t: F.cross_entropy(h @ w.T, t), tokens, d, vocab)
    chunked = _peak(lambda h, w, t: chunked_cross_entropy(h, w, t, chunk), tokens, d, vocab)
    logits = tokens * vocab * 4
    grads = (tokens + vocab) * d * 4                       # dH and dW: the same in both
    assert plain >= 2 * logits                              # logits and their softmax/gradient at once
    assert chunked <= grads + 4 * tokens * chunk * 4 + 64 * tokens, (chunked, grads)
    assert chunked * 4 < plain


def test_bad_input_refused():
    hidden, weight, targets = problem(4, 8, 10, torch.float64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        chunked_cross_entropy(hidden, weight, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="chunk must be"):
        chunked_cross_entropy(hidden, weight, targets, chunk=0)
    with pytest.raises(ValueError, match="targets must be integer"):
        chunked_cross_entropy(hidden, weight, targets.double())

"""Vocabulary-parallel embedding and cross-entropy against nn.Embedding and F.cross_entropy.

float64 logits: loss and gradient must agree to 1e-12 (only the order of three sums changes). Vocabulary
sizes that t does not divide are padded; V=5 on 4 ranks leaves the last rank with padding only.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minipar import launch
from minipar.tensor.vocab import padded_vocab_size

QUIET = {"quiet": True}


def _vocab_ops_vs_full(rank, world_size):
    from minipar import comm
    from minipar.mesh import Mesh
    from minipar.tensor.operators import all_gather_dim
    from minipar.tensor.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    g = torch.Generator().manual_seed(0)
    diffs, reductions = {}, {}
    for vocab in (10, 5, 16):
        padded = padded_vocab_size(vocab, world_size)
        logits = torch.randn(3, 7, vocab, generator=g, dtype=torch.float64) * 3
        targets = torch.randint(vocab, (3, 7), generator=g)
        for eps in (0.0, 0.1):
            full = logits.clone().requires_grad_(True)
            want = F.cross_entropy(full.reshape(-1, vocab), targets.reshape(-1), label_smoothing=eps,
                                   reduction="none").view(3, 7)
            want.sum().backward()
            padded_logits = torch.cat([logits, torch.full((3, 7, padded - vocab), 7.0, dtype=torch.float64)], -1)
            mine = padded_logits.chunk(world_size, -1)[rank].clone().requires_grad_(True)
            with comm.recording() as log:
                got = vocab_parallel_cross_entropy(mine, targets, group, vocab, label_smoothing=eps)
            reductions[(vocab, eps)] = log.count("all_reduce")
            got.sum().backward()
            grad = all_gather_dim(mine.grad, -1, group)
            diffs[(vocab, eps, "loss")] = float((got - want).abs().max())
            diffs[(vocab, eps, "grad")] = float((grad[..., :vocab] - full.grad).abs().max())
            diffs[(vocab, eps, "grad on padding")] = float(grad[..., vocab:].abs().max()) if padded > vocab else 0.0

        emb = nn.Embedding(vocab, 6).double()
        ids = torch.randint(vocab, (2, 9), generator=g)
        mine = VocabParallelEmbedding(emb, group)
        out_mine, out_full = mine(ids), emb(ids)
        (out_mine * out_mine.detach()).sum().backward()
        (out_full * out_full.detach()).sum().backward()
        diffs[(vocab, "embedding out")] = float((out_mine - out_full).abs().max())
        grad = all_gather_dim(mine.weight.grad, 0, group)[:vocab]
        diffs[(vocab, "embedding grad")] = float((grad - emb.weight.grad).abs().max())
    return diffs, reductions


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_loss_and_embedding_equal_the_full_ones(tp):
    for rank, (diffs, reductions) in enumerate(launch(_vocab_ops_vs_full, tp, **QUIET)):
        for what, d in diffs.items():
            assert d < 1e-12, f"rank {rank}: {what} differs by {d}"
        assert set(reductions.values()) == {3}, reductions   # max, target logit, sum-exp (and sum of logits)


def test_padded_vocab_size():
    assert [padded_vocab_size(v, 4) for v in (4, 5, 8, 65)] == [4, 8, 8, 68]
    assert padded_vocab_size(50257, 8) == 50264


def _full_logits_never_move(rank, world_size):
    """The bytes the loss sends do not depend on the vocabulary size: three vectors of b·s numbers."""
    from minipar import comm
    from minipar.mesh import Mesh
    from minipar.tensor.vocab import vocab_parallel_cross_entropy

    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    sent = []
    for vocab in (64, 4096):
        logits = torch.randn(4, 8, vocab // world_size)
        with comm.recording() as log:
            vocab_parallel_cross_entropy(logits, torch.zeros(4, 8, dtype=torch.long), group, vocab)
        sent.append(log.bytes_sent)
    return sent


def test_loss_communication_is_independent_of_the_vocabulary():
    for small, large in launch(_full_logits_never_move, 4, **QUIET):
        assert small == large == 3 * 2 * 3 / 4 * 4 * 8 * 4   # 3 all-reduces of 32 float32

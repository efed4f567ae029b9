"""Reference models and datasets: deterministic from a seed, right shapes, trainable in seconds."""
import pytest
import torch

from minipar.check import gpt_recipe, train_reference
from minipar.datasets import char_corpus, lm_batch, markov_tokens
from minipar.models import MLP, GPTConfig, TinyGPT


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_models_are_deterministic_from_a_seed_and_leave_global_rng_alone():
    state = torch.get_rng_state()
    assert _same(TinyGPT(GPTConfig(), seed=1), TinyGPT(GPTConfig(), seed=1))
    assert not _same(TinyGPT(GPTConfig(), seed=1), TinyGPT(GPTConfig(), seed=2))
    assert _same(MLP(seed=3), MLP(seed=3))
    assert torch.equal(state, torch.get_rng_state())


def test_tiny_gpt_shapes_tying_and_causality():
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32, tie_weights=True)
    model = TinyGPT(cfg, seed=0)
    idx = torch.randint(50, (3, 16))
    assert model(idx).shape == (3, 16, 50)
    assert model.head.weight is model.tok_emb.weight
    # causal: changing a later token never changes earlier logits
    idx2 = idx.clone()
    idx2[:, 10] = (idx2[:, 10] + 1) % 50
    assert torch.allclose(model(idx)[:, :10], model(idx2)[:, :10])
    assert not torch.allclose(model(idx)[:, 10:], model(idx2)[:, 10:])
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="not divisible by n_head"):
        TinyGPT(GPTConfig(n_embd=30, n_head=4))


def test_dropout_is_off_by_default_and_can_be_turned_on():
    idx = torch.randint(64, (2, 8))
    model = TinyGPT(GPTConfig(), seed=0).train()
    assert torch.equal(model(idx), model(idx))
    noisy = TinyGPT(GPTConfig(dropout=0.5), seed=0).train()
    assert not torch.equal(noisy(idx), noisy(idx))


def test_datasets_are_deterministic_and_learnable():
    assert torch.equal(markov_tokens(100, seed=4), markov_tokens(100, seed=4))
    x, y = lm_batch(markov_tokens(500), batch_size=4, seq_len=8, step=0)
    assert x.shape == y.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    ids, vocab = char_corpus()
    assert "".join(vocab[i] for i in ids[:10].tolist()) == "A model to"
    losses = train_reference(gpt_recipe(steps=30, batch_size=16)).losses
    assert losses[-1] < 0.8 * losses[0]                          # it learns something in 30 steps

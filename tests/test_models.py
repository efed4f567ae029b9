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


def test_embedding_seam_takes_the_positions_a_rank_holds():
    """A context-parallel rank embeds its tokens at their global positions (zig-zag: two chunks)."""
    from minipar.models import token_positions
    model = TinyGPT(GPTConfig(block_size=16), seed=0).double()
    idx = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    whole = model.embed(idx)
    assert torch.equal(whole, model.embed(idx, torch.arange(16)))
    held = torch.cat([torch.arange(0, 4), torch.arange(12, 16)])         # rank 0 of 2, zig-zag chunks of 4
    assert torch.equal(model.embed(idx[:, held], held), whole[:, held])
    assert not torch.allclose(model.embed(idx[:, held]), whole[:, held])  # positions 0..7 would be wrong
    assert torch.equal(model(idx), model(idx, token_positions(16, 16)))
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_attention_core_is_one_seam_a_strategy_replaces():
    from minipar.models import attention_core, causal_attention, set_attention_core
    model = TinyGPT(GPTConfig(n_layer=2), seed=0).double()
    names = [n for n, _ in model.named_parameters()]
    idx = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    want = model(idx)
    calls = []

    def counting(q, k, v):
        calls.append(tuple(q.shape))
        return causal_attention(q, k, v)

    with attention_core(model, counting):
        assert torch.equal(model(idx), want)
    assert calls == [(2, 4, 16, 8)] * 2                                   # every block, (b, heads, s, d)
    set_attention_core(model, lambda q, k, v: torch.zeros_like(q))
    assert not torch.allclose(model(idx), want)
    set_attention_core(model, None)
    assert torch.equal(model(idx), want) and len(calls) == 2
    with pytest.raises(RuntimeError), attention_core(model, counting):
        raise RuntimeError("a failing step restores the causal core too")
    assert "core" not in model.blocks[0].attn.__dict__
    assert [n for n, _ in model.named_parameters()] == names and "blocks.1.attn.qkv.bias" in names


def test_pipeline_first_stage_embeds_through_the_seam():
    from minipar.pipeline.stages import split_model
    model = TinyGPT(GPTConfig(n_layer=2, block_size=16), seed=0)
    first = split_model(model, 2)[0]
    idx = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(first(idx), model.blocks[0](model.embed(idx)))
    with pytest.raises(ValueError, match="exceeds block_size"):
        first(torch.zeros(1, 17, dtype=torch.long))

"""The tiny GPT trained with context parallelism equals single-device training (loss at every step and every
parameter after real Adam steps, float64), for every method; bad shapes refused before any process starts."""
import pytest
import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.sequence import context_parallel as cp


def recipe(**changes):          # 2 steps: Adam's state is used from step 2
    r = gpt_recipe(steps=2, batch_size=2, seq_len=16, **changes)
    r.dtype = torch.float64
    return r


@pytest.fixture(scope="module")
def reference():
    """The one-device run, computed once for the five methods (the same recipe each time)."""
    return train_reference(recipe())


@pytest.mark.parametrize("method,n", [("ring", 4), ("ring-zigzag", 4), ("ring-zigzag", 2), ("ulysses", 4),
                                      ("rsa", 4)])
def test_context_parallel_gpt_equals_one_device(reference, method, n):
    r = recipe()
    results = cp.run(r, world_size=n, method=method, quiet=True)
    comparison = compare(reference, results, dtype=torch.float64)
    comparison.assert_ok()


def test_refused_before_launch():
    with pytest.raises(ValueError, match="2N = 8"):
        cp.validate(gpt_recipe(seq_len=12), world_size=4, method="ring-zigzag")
    with pytest.raises(ValueError, match="n_head = 4 is not divisible by N = 3"):
        cp.validate(gpt_recipe(seq_len=12), world_size=3, method="ulysses")
    with pytest.raises(ValueError, match="divisible by 3"):
        cp.validate(gpt_recipe(seq_len=16), world_size=3, method="ring")
    with pytest.raises(ValueError, match="unknown context-parallel method"):
        cp.validate(recipe(), world_size=4, method="striped")
    with pytest.raises(ValueError, match="dropout"):
        cp.validate(recipe(dropout=0.1), world_size=4, method="ring")
    cp.validate(gpt_recipe(seq_len=12), world_size=4, method="ring")     # 12 = 4 · 3: contiguous is fine


def _tp_times_cp(rank, world_size, method):
    """TP=2 × CP=2 through the model's seams: the TP model, a CP core, this rank's tokens at their global
    positions. Logits, and gradients summed over the CP group, against one device (float64)."""
    from minipar import comm
    from minipar.mesh import Mesh
    from minipar.models import GPTConfig, TinyGPT, set_attention_core
    from minipar.tensor.gpt import TensorParallelGPT
    from minipar.tensor.layers import shard_rows
    from minipar.tensor.vocab import vocab_parallel_cross_entropy

    mesh = Mesh(world_size, cp=2, tp=2).build(rank)
    cp_group, tp_group, cp_rank, tp_rank = mesh.group("cp"), mesh.group("tp"), mesh.coord("cp"), mesh.coord("tp")
    ref = TinyGPT(GPTConfig(n_layer=2), seed=0).double()
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(64, (2, 16), generator=g), torch.randint(64, (2, 16), generator=g)
    want = ref(idx)
    torch.nn.functional.cross_entropy(want.reshape(-1, 64), targets.reshape(-1)).backward()
    want_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad(set_to_none=True)

    model = set_attention_core(TensorParallelGPT(ref, tp_group), cp.attention_for(method, cp_group))
    pos = cp.local_positions(16, cp_rank, 2, method)
    logits = model(idx[:, pos], pos)                                     # my tokens, my vocabulary columns
    loss = vocab_parallel_cross_entropy(logits, targets[:, pos], tp_group, 64).sum() / targets.numel()
    loss.backward()
    comm.all_reduce_flat([p.grad for p in model.parameters()], group=cp_group)
    qkv = model.blocks[0].attn.qkv.weight.grad
    return ((logits - want[:, pos, 32 * tp_rank: 32 * (tp_rank + 1)]).abs().max().item(),
            (qkv - shard_rows(want_grads["blocks.0.attn.qkv.weight"], tp_rank, 2, parts=3)).abs().max().item(),
            (model.ln_f.weight.grad - want_grads["ln_f.weight"]).abs().max().item())


@pytest.mark.parametrize("method", ["ring-zigzag", "ulysses"])
def test_a_cp_core_plugs_into_the_tensor_parallel_model(method):
    """The seams compose: the CP method replaces only the core of TP's attention (its local heads)."""
    from minipar import launch
    for logits, qkv_grad, ln_grad in launch(_tp_times_cp, 4, method, quiet=True):
        assert logits < 1e-12 and qkv_grad < 1e-12 and ln_grad < 1e-12, (logits, qkv_grad, ln_grad)

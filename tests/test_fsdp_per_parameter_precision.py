"""Per-parameter FSDP under a 16-bit policy (``param_dtype`` FP16 or BF16, ``reduce_dtype`` FP32, norms in FP32)
equals the flat design bit for bit and one device under the same policy within 1e-4, on a model with an
embedding, a head tied to it and two LayerNorms, after two AdamW steps on 2 ranks.

The one-device reference: FP32 masters, a 16-bit compute copy of every parameter but the norms' (theirs FP32, their
input upcast and output cast back), the loss in FP32, the gradients upcast to FP32 for the optimizer. Not exact: the
ranks' 16-bit gradients of half batches are summed (in FP32) where one device sums in 16 bits; AdamW's first steps
move each weight by about lr·sign(g), so only a gradient whose sign differs would move a weight by ~lr (measured:
7.5e-9 in both dtypes). Reading the state dict through the 16-bit compute copy, as this design did, rounds every FP32
master to 16 bits: 9.0e-4 (FP16) and 3.7e-3 (BF16) off, above the tolerance."""
import pytest
import torch
import torch.nn as nn

from minipar import launch
from minipar.data.fsdp import FSDP, is_norm
from minipar.loop import shard_batch

VOCAB, DIM, BATCH, SEQ, WORLD, STEPS, TOL = 32, 16, 8, 6, 2, 2, 1e-4


class TiedLM(nn.Module):
    """Embedding -> LayerNorm -> Linear residual -> LayerNorm -> head tied to the embedding."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb, self.norm, self.mid = nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, DIM)
        self.norm2, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1 if p.dim() == 1 else 0))

    def forward(self, idx):
        h = self.emb(idx)
        h = h + torch.tanh(self.mid(self.norm(h)))
        return self.head(self.norm2(h))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def _loss(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _on_rank(rank, world_size, dtype):
    out = {}
    for per_parameter in (True, False):
        model = FSDP(TiedLM(), per_parameter=per_parameter, param_dtype=dtype, reduce_dtype=torch.float32,
                     units=lambda m: [m])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for x, y in _batches():
            x, y = shard_batch((x, y), rank, world_size)
            _loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[per_parameter] = model.state_dict(), model.full_state_dict() if per_parameter else None
    return out


def _one_device(dtype):
    master = TiedLM()
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    for x, y in _batches():
        compute = TiedLM()
        compute.load_state_dict(master.state_dict())
        for m in compute.modules():
            if is_norm(m):
                m.register_forward_pre_hook(lambda m, args: (args[0].float(),))
                m.register_forward_hook(lambda m, args, out: out.to(dtype))
            else:
                for p in m.parameters(recurse=False):
                    p.data = p.data.to(dtype)                  # the tied weight once: both modules hold it
        _loss(compute(x), y).backward()
        for p, q in zip(master.parameters(), compute.parameters()):
            p.grad = q.grad.float()
        opt.step()
        opt.zero_grad()
    return master.state_dict()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_per_parameter_keeps_the_flat_designs_precision(dtype):
    want = _one_device(dtype)
    for out in launch(_on_rank, WORLD, dtype, quiet=True):
        (per_parameter, full), (flat, _) = out[True], out[False]
        assert per_parameter.keys() == flat.keys() == want.keys()
        for name, p in per_parameter.items():
            assert p.dtype == torch.float32, name
            assert torch.equal(p, flat[name]), name                     # the two designs agree exactly
            torch.testing.assert_close(p, want[name], atol=TOL, rtol=0, msg=name)
        for name, p in full.items():                  # named_parameters: the tied weight once
            assert torch.equal(p, per_parameter[name]), name


def _big_layers(model):
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]


def _tied_weight_split(rank, world_size):
    try:
        FSDP(TiedLM(), per_parameter=True, units=_big_layers)
    except ValueError as error:
        return str(error)


def test_a_tied_weight_split_over_units_is_refused():
    """The head tied to the embedding, each its own unit: the head would compute with the embedding's shard
    (a (2, 3, 16)-shaped output over 2 ranks, not 32 words, silently, before this check)."""
    for message in launch(_tied_weight_split, WORLD, quiet=True):
        assert message is not None and "head.weight" in message and "'emb'" in message and "tied" in message

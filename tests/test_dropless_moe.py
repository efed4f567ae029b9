"""Dropless expert parallelism (minipar.moe.dropless) against one device: training in float64 (ep 4; ep 2 × dp 2),
nothing dropped under a planted worst case (every token to one expert), the grouped GEMM against one matmul per
expert, the bytes of each uneven all-to-all against k·T·M·b·(ep−1)/ep, and one host sync per layer forward."""
import pytest
import torch

from minipar import comm, launch
from minipar.check import compare, train_reference
from minipar.models import FeedForward, GPTConfig
from minipar.moe import dropless
from minipar.moe import expert_parallel as epm
from minipar.moe.layer import MoEConfig, MoEGPT, moe_recipe

F64 = torch.float64


def _recipe(k=1, experts=4, **kw):       # 2 steps: Adam's state (and routing after an update) from step 2
    return moe_recipe(steps=2, batch_size=8, dtype=F64, experts=experts, k=k, dropless=True, **kw)


_REFERENCES = {}


def _reference(k):
    """One-device run per k, computed once: (4, 2, 2) and (2, 2, 2) share k = 2's."""
    if k not in _REFERENCES:
        _REFERENCES[k] = train_reference(_recipe(k=k, capacity_factor=1.0))
    return _REFERENCES[k]


@pytest.mark.parametrize("world_size,ep,k", [(4, 4, 1), (4, 2, 2), (2, 2, 2)])
def test_training_equals_one_device(world_size, ep, k):
    recipe = _recipe(k=k, capacity_factor=1.0)     # cf is unused: dropless keeps every token whatever it says
    c = compare(_reference(k), dropless.run(recipe, world_size=world_size, ep=ep), dtype=F64)
    c.assert_ok()


def _planted(dropless_layers: bool, capacity_factor=1.25):
    """Every token's first choice is expert 0: a routing bias of 1e3 on it (loss-free balancing with a rate too
    small to move it in 2 steps), the worst imbalance there is. 2 steps: the second routes after an update."""
    recipe = moe_recipe(steps=2, batch_size=8, dtype=F64, experts=4, k=1, alpha=0.0, capacity_factor=capacity_factor)
    cfg = recipe.model().cfg
    moe = MoEConfig(experts=4, k=1, capacity_factor=capacity_factor, alpha=0.0, bias_rate=1e-9, dropless=dropless_layers)

    def model():
        m = MoEGPT(cfg, moe)
        for layer in m.moe_layers():
            layer.routing_bias[0] = 1e3
        return m
    recipe.model = model
    return recipe


def _routed(rank, world_size, recipe, train, ep):
    routings, log = [], comm.CommLog()
    result = train(rank, world_size, recipe, ep=ep, routings=routings, step_log=log)
    return result, routings, log.select(op="all_to_all").bytes_sent


def test_planted_worst_case_drops_nothing_and_equals_one_device():
    recipe = _planted(True)
    reference, _ = epm.loss_free_reference(recipe)
    out = launch(_routed, 4, recipe, dropless.parallel_train, 4, quiet=True)
    compare(reference, [o[0] for o in out], dtype=F64).assert_ok()
    for rank, (_, routings, _) in enumerate(out):
        for layers in routings:
            for load, dropped in layers:
                assert dropped == 0 and load.tolist() == [32, 0, 0, 0], (rank, load)   # all 32 tokens to expert 0
    # the padded layers with cf 1.25 (C = 10 of 32) drop 22 of every rank's 32 tokens per layer
    padded = launch(_routed, 4, _planted(False), epm.parallel_train, 4, quiet=True)
    assert all(d == 22 for _, routings, _ in padded for layers in routings for _, d in layers)


def _exchange(rank, world_size, counts, width):
    """One dropless layer's run_dropless on rows planted with ``counts`` (ep × E), forward and backward, logged."""
    torch.manual_seed(rank)
    ep = world_size
    layer = _layer(counts.shape[1], width, ep, rank)
    rows = torch.randn(int(counts[rank].sum()), width, requires_grad=True)
    with comm.recording() as log:
        out = layer.run_dropless(rows, counts[rank])
        out.backward(torch.ones_like(out))
    a2a = log.select(op="all_to_all")
    return [r.sent_bytes for r in a2a.records], a2a.observed_bytes_sent, layer.host_syncs, layer.last_path


def _layer(experts, width, ep, rank):
    import torch.distributed as dist
    from minipar.moe.layer import MoELayer
    cfg = GPTConfig(n_embd=width, n_head=1, n_layer=1)
    full = MoELayer(cfg, MoEConfig(experts=experts, dropless=True))
    return dropless.DroplessMoE(full, rank, ep, dist.group.WORLD, dist.group.WORLD)


def test_each_exchange_sends_k_T_M_b_times_ep_minus_1_over_ep_and_one_host_sync():
    ep, experts, width, k, t = 4, 8, 16, 2, 32
    uniform = torch.full((ep, experts), k * t // experts)               # n(e) = k·T/E on every rank
    out = launch(_exchange, ep, uniform, width, quiet=True)
    formula = k * t * width * 4 * (ep - 1) / ep
    for sent, observed, syncs, path in out:
        assert sent[0] == experts * 8 * (ep - 1) / ep                 # the split sizes: E/ep int64 to each peer
        assert sent[1:] == [formula] * 4, sent                     # dispatch, combine, and both backward
        assert syncs == 1 and path == "grouped"                    # float32, 16-byte rows: one grouped GEMM
        if observed is not None:
            assert observed >= sum(sent)
    skewed = torch.tensor([[5, 0, 3, 1, 0, 0, 7, 2], [0, 0, 0, 0, 9, 9, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8],
                           [0, 0, 0, 0, 0, 0, 0, 0]])
    predicted = dropless.predicted_exchange_bytes(skewed, width, ep)
    for rank, (sent, _, _, _) in enumerate(launch(_exchange, ep, skewed, width, quiet=True)):
        dispatch, combine = predicted["dispatch"][rank], predicted["combine"][rank]
        assert sent[1:] == [dispatch, combine, dispatch, combine], (rank, sent)   # backward: each reversed


def test_grouped_gemm_equals_one_matmul_per_expert():
    cfg = GPTConfig(n_embd=16, n_head=1, n_layer=1)
    torch.manual_seed(0)
    experts = [FeedForward(cfg) for _ in range(3)]
    counts = [5, 0, 11]
    rows = torch.randn(16, 16, requires_grad=True)
    got, path = dropless.grouped_ffn(experts, rows, counts)
    want, loop = dropless.grouped_ffn(experts, rows, counts, grouped=False)
    assert (path, loop) == ("grouped", "per expert")
    assert torch.allclose(got, want, atol=1e-6)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, [rows, experts[2].fc.weight], g)
    want_grads = torch.autograd.grad(want, [rows, experts[2].fc.weight], g)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, want_grads))
    doubled = [e.double() for e in experts]                 # no float64 grouped GEMM on CPU: one matmul per expert
    assert dropless.grouped_ffn(doubled, rows.detach().double(), counts)[1] == "per expert"


def test_a_padded_recipe_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="dropless"):
        dropless.run(moe_recipe(steps=1, batch_size=8), world_size=4, ep=4)

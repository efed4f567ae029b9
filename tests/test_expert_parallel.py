"""Expert parallelism against the same MoE on one device (no dropping): outputs, gradients, the aux loss and
its gradient across EP sizes and micro-batch counts; training over real Adam steps in float64, EP alone and
EP x DP; bad configurations refused before any process starts; all-to-all bytes observed on the wire."""
import pytest
import torch

from minipar import comm, launch
from minipar.check import compare, gpt_recipe, train_reference
from minipar.loop import lm_loss, shard_batch
from minipar.moe import expert_parallel as epm
from minipar.moe.layer import moe_recipe, no_drop_capacity_factor
from minipar.moe.router import capacity

F64 = torch.float64


def _recipe(k=1, experts=4, **kw):
    kw.setdefault("capacity_factor", no_drop_capacity_factor(experts, k))   # C >= T: nothing is dropped
    return moe_recipe(steps=3, batch_size=8, dtype=F64, experts=experts, k=k, **kw)


_REFERENCES = {}


def reference(make, **kw):
    """``train_reference(make(**kw))``, trained once per session: several tests (and parameters) compare with
    the one-device run of the same recipe."""
    key = (make, tuple(sorted(kw.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = train_reference(make(**kw))
    return _REFERENCES[key]


# ---- one forward/backward: outputs, loss pieces, gradients, aux-loss gradient --------------------------

def _one_step(rank, world_size, recipe, ep, micro_batches):
    model, names, mesh = epm.build(rank, world_size, recipe, ep)
    inputs, targets = shard_batch(recipe.batches[0], rank, world_size)
    logits, auxes = [], []
    for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
        out = model(x)
        aux = model.aux_loss()
        ((lm_loss(out, y) + aux) / micro_batches).backward()
        logits.append(out.detach())
        auxes.append(aux.detach())
    epm.sync_gradients(model, None, mesh.group("dp"), world_size)
    grads = {names[n]: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for x in inputs.chunk(micro_batches):       # the aux loss alone, through the same averaging
        model(x)
        (model.aux_loss() / micro_batches).backward()
    epm.sync_gradients(model, None, mesh.group("dp"), world_size)
    aux_grads = {names[n]: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, auxes, grads, aux_grads


def _reference_one_step(recipe, world_size, micro_batches):
    """One device; micro-batch j = the j-th chunk of every rank's rows (what the ranks process together)."""
    model = recipe.model().to(F64)
    shards = [shard_batch(recipe.batches[0], r, world_size) for r in range(world_size)]
    logits, auxes = [], []
    for j in range(micro_batches):
        x = torch.cat([s[0].chunk(micro_batches)[j] for s in shards])
        y = torch.cat([s[1].chunk(micro_batches)[j] for s in shards])
        out = model(x)
        aux = model.aux_loss()
        ((lm_loss(out, y) + aux) / micro_batches).backward()
        logits.append(out.detach())
        auxes.append(aux.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for j in range(micro_batches):
        model(torch.cat([s[0].chunk(micro_batches)[j] for s in shards]))
        (model.aux_loss() / micro_batches).backward()
    aux_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, auxes, grads, aux_grads


ONE_STEP_CASES = [(2, 2, 1), (2, 2, 2), (4, 4, 1), (4, 4, 2), (4, 2, 2)]
_ONE_STEPS = {}


def _one_steps(rank, world_size, recipe, ep, counts):
    return {micro_batches: _one_step(rank, world_size, recipe, ep, micro_batches) for micro_batches in counts}


def one_step_runs(world_size, ep, micro_batches) -> list:
    """Per rank, :func:`_one_step`'s result: every micro-batch count a (world size, EP size) is tested with
    runs in one launch (one start-up, not one per count)."""
    if (world_size, ep) not in _ONE_STEPS:
        counts = [mb for w, e, mb in ONE_STEP_CASES if (w, e) == (world_size, ep)]
        _ONE_STEPS[world_size, ep] = launch(_one_steps, world_size, _recipe(k=2 if ep == 2 else 1), ep, counts,
                                            quiet=True)
    return [o[micro_batches] for o in _ONE_STEPS[world_size, ep]]


@pytest.mark.parametrize("world_size,ep,micro_batches", ONE_STEP_CASES)
def test_outputs_gradients_aux_loss_and_its_gradient_equal_one_device(world_size, ep, micro_batches):
    recipe = _recipe(k=2 if ep == 2 else 1)
    ref_logits, ref_aux, ref_grads, ref_aux_grads = _reference_one_step(recipe, world_size, micro_batches)
    out = one_step_runs(world_size, ep, micro_batches)
    rows = recipe.batches[0][0].shape[0] // world_size // micro_batches
    for rank, (logits, auxes, grads, aux_grads) in enumerate(out):
        for j in range(micro_batches):
            want = ref_logits[j][rank * rows:(rank + 1) * rows]
            assert torch.allclose(logits[j], want, atol=1e-12), (rank, j)
        for name, g in grads.items():
            assert torch.allclose(g, ref_grads[name], atol=1e-12, rtol=1e-9), (rank, name)
        for name, g in aux_grads.items():   # parameters the aux loss does not reach: None there, zeros here
            want = ref_aux_grads.get(name, torch.zeros_like(g))
            assert torch.allclose(g, want, atol=1e-14, rtol=1e-9), (rank, name)
    for j in range(micro_batches):   # each rank's aux uses the global f and its own P: their mean is the global aux
        mean_aux = sum(o[1][j] for o in out) / world_size
        assert torch.allclose(mean_aux, ref_aux[j], atol=1e-14, rtol=1e-12)
    router = "blocks.0.mlp.router.weight"
    assert ref_aux_grads[router].abs().max() > 1e-8        # the aux loss really reaches the router


# ---- training over real optimizer steps ----------------------------------------------------------------

@pytest.mark.parametrize("world_size,ep,k", [(2, 2, 1), (4, 4, 1), (4, 2, 1), (4, 2, 2), (2, 1, 1)])
def test_training_equals_one_device(world_size, ep, k):
    recipe = _recipe(k=k)
    c = compare(reference(_recipe, k=k), epm.run(recipe, world_size=world_size, ep=ep), dtype=F64)
    c.assert_ok()


def test_ep_times_dp_with_micro_batches_equals_one_device_losses():
    # micro-batches change which tokens share an aux loss, so compare with the micro-batched reference step
    recipe = _recipe(k=1)
    recipe.batches = recipe.batches[:1]
    ref_logits, ref_aux, ref_grads, _ = _reference_one_step(recipe, 4, 2)
    model = recipe.model().to(F64)
    for n, p in model.named_parameters():
        p.grad = ref_grads[n]
    opt = recipe.optimizer(model.parameters())
    opt.step()
    out = epm.run(recipe, world_size=4, ep=2, micro_batches=2)
    for res in out:
        for n, p in res.params.items():
            assert torch.allclose(p, dict(model.named_parameters())[n].detach(), atol=1e-10), n


def test_dropping_runs_and_is_counted_on_every_rank():
    recipe = moe_recipe(steps=2, batch_size=8, dtype=F64, experts=4, k=1, capacity_factor=0.5)
    out = launch(_with_routings, 4, recipe, quiet=True)
    for routings in out:
        for layers in routings:
            for load, dropped in layers:
                assert int(load.max()) <= capacity(32, 4, 0.5)       # 32 tokens per rank, C = 4
                assert int(load.sum()) + dropped == 32
    assert sum(d for r in out for layers in r for _, d in layers) > 0


def _with_routings(rank, world_size, recipe):
    routings = []
    epm.parallel_train(rank, world_size, recipe, ep=4, routings=routings)
    return routings


# ---- bytes -----------------------------------------------------------------------------------------------

def _bytes(rank, world_size, recipe, ep):
    step_log = comm.CommLog()
    epm.parallel_train(rank, world_size, recipe, ep=ep, step_log=step_log)
    log = step_log.select(op="all_to_all", dims=("ep",))
    return log.bytes_sent, log.observed_bytes_sent, log.count("all_to_all")


@pytest.mark.parametrize("world_size,ep", [(4, 4), (4, 2)])
def test_all_to_all_bytes_observed_on_the_wire(world_size, ep):
    recipe = moe_recipe(steps=2, batch_size=8, experts=4, k=1, capacity_factor=1.25)
    cfg, moe = recipe.model().cfg, recipe.model().moe
    tokens = 8 // world_size * 16
    want = epm.predicted_all_to_all_bytes(tokens, cfg.n_embd, moe, ep)
    layers, steps = cfg.n_layer, recipe.steps
    for modelled, observed, calls in launch(_bytes, world_size, recipe, ep, quiet=True):
        assert calls == 4 * layers * steps                      # 2 forward + 2 backward per layer per step
        assert modelled == 2 * want["wire"] * layers * steps   # both directions
        if observed is not None:
            # per peer gloo writes a send-ready and a recv-ready notice and the data, each with a preamble
            # (48 B each with this gloo: 144 B per peer per all-to-all)
            messages = 3 * calls * (ep - 1)
            assert modelled <= observed <= modelled + 64 * messages


# ---- refused before any process starts -----------------------------------------------------------------

@pytest.mark.parametrize("recipe_kw,world_size,ep,reason", [
    (dict(experts=6), 4, 4, "divisible by the EP size"),
    (dict(experts=4), 4, 3, "divisor of the world size"),
    (dict(experts=4), 4, 0, "divisor of the world size"),
    (dict(experts=4, batch_size=6), 4, 2, "not divisible by 4"),
])
def test_bad_configurations_refused_before_launch(monkeypatch, recipe_kw, world_size, ep, reason):
    import minipar.launcher
    monkeypatch.setattr(minipar.launcher, "launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match=reason):
        epm.run(moe_recipe(steps=1, **recipe_kw), world_size=world_size, ep=ep)


@pytest.mark.parametrize("kw,reason", [(dict(k=5), "top-k"), (dict(capacity_factor=0.0), "capacity factor"),
                                       (dict(capacity_factor=-0.5), "capacity factor")])
def test_bad_router_settings_refused(kw, reason):
    with pytest.raises(ValueError, match=reason):
        moe_recipe(steps=1, experts=4, **kw)


def test_dense_recipe_refused():
    with pytest.raises(ValueError, match="MoEGPT"):
        epm.validate(gpt_recipe(steps=1), world_size=2, ep=2)


# ---- the scaling bugs these tests exist for are caught ---------------------------------------------------

def _train_with_bug(rank, world_size, recipe, ep, bug):
    """In this rank's process only (forked): replace a piece of expert_parallel by a classic mistake."""
    import torch.distributed as dist
    from minipar.moe.router import load_balancing_loss
    if bug == "expert grads / dp":
        right = epm.sync_gradients

        def wrong(model, dense_group, dp_group, world_size):
            right(model, dense_group, dp_group, world_size)
            for n, p in model.named_parameters():
                if epm.is_expert(n):                 # ÷ dp instead of ÷ W
                    p.grad *= world_size / dist.get_world_size(dp_group)
        epm.sync_gradients = wrong
    elif bug == "per-rank f":                        # f counted on this rank's tokens only
        epm.ExpertParallelMoE.balance_loss = lambda self, routing: load_balancing_loss(routing, self.moe.alpha)
    return epm.parallel_train(rank, world_size, recipe, ep=ep)


@pytest.mark.parametrize("bug", ["expert grads / dp", "per-rank f"])
def test_the_classic_scaling_bugs_do_not_match(bug):
    recipe = _recipe(k=1, alpha=0.1)
    results = launch(_train_with_bug, 4, recipe, 2, bug, quiet=True)
    c = compare(reference(_recipe, k=1, alpha=0.1), results, dtype=F64)
    assert not c.matches, f"{bug}: {c}"


@pytest.mark.parametrize("ep", [4, 2])
def test_with_dropping_equals_one_device_routing_in_the_same_groups(ep):
    # cf 1.0: tokens are dropped; the one-device model routes its batch in 4 groups, one per rank
    kw = dict(steps=3, batch_size=8, dtype=F64, experts=4, k=1, capacity_factor=1.0)
    out = launch(_train_and_count, 4, moe_recipe(groups=4, **kw), ep, quiet=True)
    assert sum(d for _, d in out) > 0                       # tokens really were dropped
    compare(reference(moe_recipe, groups=4, **kw), [r for r, _ in out], dtype=F64).assert_ok()
    one_group = reference(moe_recipe, **kw)
    assert not compare(one_group, [r for r, _ in out], dtype=F64).matches


def _train_and_count(rank, world_size, recipe, ep):
    routings = []
    result = epm.parallel_train(rank, world_size, recipe, ep=ep, routings=routings)
    return result, sum(d for layers in routings for _, d in layers)


# ---- the groups: all-to-all over ep, experts over dp, everything else over dp × ep ----------------------

def _groups(rank, world_size, recipe, ep):
    log = comm.CommLog()
    epm.parallel_train(rank, world_size, recipe, ep=ep, step_log=log)
    return [(r.op, r.ranks, r.dims, r.payload_bytes) for r in log.records]


def test_each_exchange_uses_its_mesh_group():
    from minipar import Mesh
    recipe = _recipe(k=1)
    mesh = Mesh(4, dp=2, ep=2)
    model = recipe.model()
    expert_bytes = sum(p.numel() for n, p in model.named_parameters() if epm.is_expert(n)) // 2 * 8
    dense_bytes = sum(p.numel() for n, p in model.named_parameters() if not epm.is_expert(n)) * 8
    for rank, records in enumerate(launch(_groups, 4, recipe, 2, quiet=True)):
        by_dims = {}
        for op, ranks, dims, payload in records:
            assert list(ranks) == mesh.group_ranks(dims, rank) and dims == mesh.dims_spanned(ranks)
            by_dims.setdefault((op, dims), []).append(payload)
        layers, steps = model.cfg.n_layer, recipe.steps
        assert len(by_dims[("all_to_all", ("ep",))]) == 4 * layers * steps
        assert by_dims[("all_reduce", ("dp",))] == [expert_bytes] * steps               # experts: their replicas
        dense = by_dims[("all_reduce", ("dp", "ep"))]                                    # everything else: all
        assert dense.count(dense_bytes) == steps and len(dense) == steps * (1 + layers)  # + f's counts per layer
        assert set(by_dims) == {("all_to_all", ("ep",)), ("all_reduce", ("dp",)), ("all_reduce", ("dp", "ep"))}

"""Expert parallelism inside the hybrid trainer (dp × pp × cp × tp with ep folded into dp × cp, + ZeRO-1) equals
single-device training of the MoE GPT: the loss (cross-entropy + balancing losses) at every step and every parameter,
experts included, after 2 Adam steps (the moments are used from step 2), float64, compare's tolerance (atol 1e-10,
rtol 1e-9; measured max |Δ| ≈ 1e-14 at 3 steps). The reference accumulates the run's m global micro-batches (f
counted per micro-batch); with cp = 1 it routes in the ranks' groups, so layouts that drop tokens (cf = 1) agree too;
with cp > 1 the capacity is no-drop (cf = E/k). Bytes of every kind (ep, edp, balance with dp, pp, tp, cp) equal the
formulas on every rank; a wrong expert-gradient divisor (run with SGD, where it doubles the experts' step: measured
max |Δ| ≈ 5e-3; with Adam only the ε term would see the constant 2×) and a balancing loss left out of a stage's
backward are both caught, and the same SGD run without the bug matches."""
import functools

import pytest
import torch

from minipar.check import RunResult, compare, gpt_recipe, train_reference
from minipar.hybrid.experts import expert_groups, hybrid_moe_recipe
from minipar.hybrid.parallel3d import bytes_formula, validate
from minipar.hybrid.runner import run
from minipar.layout import Layout
from minipar.mesh import Mesh

BATCH, SEQ, E = 8, 8, 4
NO_DROP = dict(k=1, capacity_factor=float(E))           # C = T: no token dropped, whatever the grouping


def recipe(layout, every=1, k=1, capacity_factor=float(E), dropout=0.0, n_layer=2, optimizer="adam"):
    # 2 steps: Adam's moments are used from step 2; a third step showed nothing more
    return hybrid_moe_recipe(layout, steps=2, batch_size=BATCH, seq_len=SEQ, experts=E, k=k,
                             capacity_factor=capacity_factor, every=every, n_layer=n_layer, n_head=4, n_embd=16,
                             dropout=dropout, optimizer=optimizer)


@functools.lru_cache(maxsize=None)
def reference(dp, cp, m, every, k, capacity_factor, n_layer=2, optimizer="adam", tp=1):
    # tp: the MoE layers route each tp rank's rows as one group, and so does the reference (groups = dp·tp)
    return train_reference(recipe(Layout(dp=dp, cp=cp, tp=tp, micro_batches=m), every, k, capacity_factor,
                                  n_layer=n_layer, optimizer=optimizer))


LAYOUTS = {      # 8 ranks each: (layout fields, MoE fields)
    "dp2 cp2 tp2 ep2 ring": (dict(dp=2, cp=2, tp=2, ep=2, schedule="gpipe"), NO_DROP),
    "dp2 pp2 tp2 ep2 top2 drops": (dict(dp=2, pp=2, tp=2, ep=2), dict(k=2, capacity_factor=1.0)),
    "dp4 pp2 ep4 zero1 drops": (dict(dp=4, pp=2, ep=4, zero=1), dict(k=1, capacity_factor=1.0)),
    "dp2 cp2 pp2 ep4 zigzag": (dict(dp=2, cp=2, pp=2, ep=4, cp_method="ring-zigzag"), NO_DROP),
    "dp2 cp2 pp2 ep2 ulysses zero1 every2": (dict(dp=2, cp=2, pp=2, ep=2, zero=1, cp_method="ulysses",
                                                  schedule="gpipe"), dict(NO_DROP, every=2)),
    "dp2 pp2 tp2 ep2 interleaved v2": (dict(dp=2, pp=2, tp=2, ep=2, schedule="interleaved", v=2),
                                       dict(NO_DROP, n_layer=4)),
    "dp2 pp2 tp2 ep4 folded over tp, drops": (dict(dp=2, pp=2, tp=2, ep=4), dict(k=2, capacity_factor=1.0)),
    "dp1 pp2 tp4 ep4 folded over tp": (dict(dp=1, pp=2, tp=4, ep=4), NO_DROP),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_device(name):
    fields, moe = LAYOUTS[name]
    layout = Layout(**fields, micro_batches=2)
    assert layout.world_size == 8
    r = recipe(layout, **moe)
    runs = run(r, layout=layout)
    ref = reference(layout.dp, layout.cp, 2, moe.get("every", 1), moe["k"], moe["capacity_factor"],
                    moe.get("n_layer", 2), tp=layout.tp)
    compare(ref, runs, dtype=torch.float64).assert_ok()
    model = r.model()
    held = {n for res in runs for n in res.params if ".experts." in n}
    assert held == {n for n, _ in model.named_parameters() if ".experts." in n}     # every expert, global names
    for res in runs:                   # bytes per kind: the group-tagged log equals the formula on every rank
        want = bytes_formula(model.cfg, batch=BATCH, seq=SEQ, layout=layout, pp_rank=res.coords["pp"], moe=model.moe)
        assert set(res.bytes_by_kind) == set(want) and res.bytes_by_kind == pytest.approx(want)
    assert any(res.bytes_by_kind["ep"] > 0 for res in runs)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if "drops" in n])
def test_the_drop_layouts_drop_tokens(name):
    """The layouts said to drop do drop: the reference's routing of the first micro-batch loses token-choices."""
    fields, moe = LAYOUTS[name]
    layout = Layout(**fields, micro_batches=2)
    model = recipe(layout, **moe).model().double()
    inputs = recipe(layout, **moe).batches[0][0]
    model(inputs.reshape(layout.dp, 2, -1, SEQ)[:, 0].reshape(-1, SEQ))
    assert sum(layer.routing.dropped for layer in model.moe_layers()) > 0


@pytest.mark.parametrize("fields", [dict(dp=2, cp=2, tp=2, ep=2), dict(dp=4, pp=2, ep=2), dict(dp=2, cp=4, ep=4),
                                    dict(dp=4, cp=2, ep=8), dict(dp=2, cp=2, pp=2, ep=1), dict(dp=2, tp=2, ep=4),
                                    dict(dp=1, pp=2, tp=4, ep=4)])
def test_ep_and_expert_dp_partition_every_stages_token_group(fields):
    """ep folds over a stage's dp × cp × tp ranks (Megatron-Core's folding): one plan per pipeline stage."""
    layout = Layout(**fields)
    mesh = Mesh(layout.world_size, **layout.sizes)
    plan = expert_groups(mesh, layout.ep)
    assert len(plan) == layout.pp
    for dense, (ep_sets, edp_sets) in zip(mesh.groups("dp", "cp", "tp"), plan):
        assert {len(s) for s in ep_sets} == {layout.ep} and {len(s) for s in edp_sets} == {layout.expert_data_parallel}
        for sets in (ep_sets, edp_sets):
            assert sorted(r for s in sets for r in s) == sorted(dense)            # a partition of the dense group
        assert all(len(set(a) & set(b)) == 1 for a in ep_sets for b in edp_sets)    # one rank per (ep, expert-DP)


def _with_bug(rank, world_size, recipe, layout, bug):
    """The trainer with one plausible bug: expert gradients ÷ expert-DP instead of ÷ dp·cp, or the balancing loss
    left out of the first stage's backward (only the last stage's loss seeded); ``bug=None``: as shipped."""
    from minipar.hybrid.parallel3d import Trainer3D
    t = Trainer3D(rank, world_size, recipe, layout=layout)
    if bug == "divisor":
        t.experts.divisor = layout.expert_data_parallel
    elif bug == "aux" and t.mesh.coord("pp") == 0:
        for layer in t.experts.layers:
            layer.aux_scale = 0.0
    losses = [t.step(x, y, i) for i, (x, y) in enumerate(recipe.batches)]
    return RunResult(losses if losses[0] is not None else None, t.full_params())


def _compare_with_bug(bug, fields, optimizer):
    from minipar import launch
    layout = Layout(**fields, micro_batches=2)
    runs = launch(_with_bug, 4, recipe(layout, optimizer=optimizer), layout, bug, quiet=True)
    ref = reference(layout.dp, 1, 2, 1, 1, float(E), optimizer=optimizer)
    return compare(ref, runs, dtype=torch.float64), runs, ref


DIVISOR_LAYOUT = dict(dp=4, ep=2, schedule="gpipe")       # expert-DP 2, dp·cp 4: the bug doubles g_expert


@pytest.mark.parametrize("bug, fields, optimizer, wrong, at_least", [
    ("divisor", DIVISOR_LAYOUT, "sgd", ".experts.", 1e-4),    # SGD: 2·g doubles the step (Adam would cancel it)
    ("aux", dict(dp=2, pp=2, ep=2), "adam", "blocks.0.mlp.router.weight", 1e-3),
])
def test_the_comparison_catches_the_bugs(bug, fields, optimizer, wrong, at_least):
    comparison, runs, ref = _compare_with_bug(bug, fields, optimizer)
    assert not comparison.matches, str(comparison)
    worst = max((p - ref.params[n]).abs().max().item() for res in runs for n, p in res.params.items() if wrong in n)
    print(bug, optimizer, f"max |Δ| on {wrong!r}: {worst:.3g}", comparison)
    assert worst > at_least, f"the {bug} bug moves {wrong!r} by only {worst:.3g}: caught by rounding, not loudly"


def test_the_sgd_comparison_passes_without_the_bug():
    """The same SGD run, as shipped: equal to one device (so the divisor case above fails because of the bug)."""
    comparison, _, _ = _compare_with_bug(None, DIVISOR_LAYOUT, "sgd")
    comparison.assert_ok()


def test_the_divisor_bug_doubles_the_sgd_step_of_every_expert():
    """One SGD step: with ÷ expert-DP (2) instead of ÷ dp·cp (4) every expert moves exactly twice as far as on one
    device (Δp = −lr·2g), every other parameter as far: the bug is the constant 2× the test above catches."""
    from minipar import launch
    layout = Layout(**DIVISOR_LAYOUT, micro_batches=2)
    r = recipe(layout, optimizer="sgd")
    r.batches = r.batches[:1]
    runs = launch(_with_bug, 4, r, layout, "divisor", quiet=True)
    start = {n: p.detach().to(r.dtype) for n, p in r.model().named_parameters()}
    ref = train_reference(r)
    for res in runs:
        for n, p in res.params.items():
            factor = 2.0 if ".experts." in n else 1.0
            torch.testing.assert_close(p - start[n], factor * (ref.params[n] - start[n]), atol=1e-12, rtol=1e-9)
    assert any((ref.params[n] - start[n]).abs().max() > 1e-4 for n in start if ".experts." in n)   # a real step


@pytest.mark.parametrize("fields, moe, words", [
    (dict(dp=3, ep=3), {}, "4 experts cannot be spread evenly over an expert-parallel group of 3"),
    (dict(dp=2, tp=2, sp=True, ep=2), {}, "sequence parallelism with an MoE model"),
    (dict(dp=2, pp=2, ep=2, recompute="full"), {}, "recompute='full' with an MoE model"),
    (dict(dp=2, ep=2), dict(dropout=0.1), "dropout = 0.1 with an MoE model"),
    (dict(dp=2, cp=2, ep=4, pp=2), {}, None),
])
def test_validate(fields, moe, words):
    layout = Layout(**fields, micro_batches=2)
    r = recipe(layout, **moe)
    if words is None:
        validate(r, layout=layout)
        return
    with pytest.raises(ValueError, match=words):
        validate(r, layout=layout)


def test_validate_refuses_ep_without_experts_and_ep_not_dividing_dp_cp_tp():
    dense = gpt_recipe(steps=1, batch_size=BATCH, seq_len=SEQ, n_layer=2, n_head=4)
    with pytest.raises(ValueError, match="ep=2: expert parallelism needs a mixture-of-experts model"):
        validate(dense, layout=Layout(dp=2, ep=2, micro_batches=2))
    with pytest.raises(ValueError, match="ep=4 must divide dp·cp·tp = 2"):
        validate(recipe(Layout(dp=2)), layout=Layout(dp=2, ep=4, micro_batches=2))
    with pytest.raises(ValueError, match="token count divisible by tp"):   # 1 row × 8 tokens, tp 3: 8 % 3
        validate(recipe(Layout(dp=2, tp=3)), layout=Layout(dp=2, tp=3, ep=2, micro_batches=4))


def test_run_validates_before_starting(monkeypatch):
    monkeypatch.setattr("minipar.launcher.launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match="sequence parallelism with an MoE model"):
        run(recipe(Layout(dp=2)), layout=Layout(dp=2, tp=2, sp=True, ep=2, micro_batches=2))


CLI = ["--batch-size", "8", "--seq-len", "8", "--micro-batches", "2", "--dtype", "float64", "--steps", "2",
       "--n-layer", "2", "--n-embd", "16", "--experts", "4", "--top-k", "2", "--capacity-factor", "2", "--json"]


def test_train_command_with_ep_equals_one_device(capfd):
    import json
    from minipar.hybrid.cli import build_parser, main, make_recipe
    flags = ["--dp", "2", "--pp", "2", "--tp", "2", "--ep", "2", *CLI]
    ref = train_reference(make_recipe(build_parser().parse_args(flags)))
    capfd.readouterr()
    assert main(flags) == 0
    out, err = capfd.readouterr()
    losses = [json.loads(line)["loss"] for line in out.splitlines()]
    assert len(losses) == 2 and err.count("step    1/") == 1
    assert losses == pytest.approx(ref.losses, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("flags, words", [
    (["--dp", "2", "--ep", "2", "--experts", "0"], "expert parallelism needs a mixture-of-experts model"),
    (["--dp", "3", "--ep", "3"], "4 experts cannot be spread evenly"),
    (["--ep", "2"], "ep=2 must divide dp·cp·tp = 1"),
    (["--top-k", "0"], "--top-k must be a positive integer"),
    (["--experts", "-1"], "--experts must be >= 0"),
    (["--top-k", "5"], "top-k=5 must be between 1 and the number of experts"),
])
def test_train_command_refuses_before_launch(capfd, monkeypatch, flags, words):
    from minipar.hybrid.cli import main
    monkeypatch.setattr("minipar.launcher.launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(SystemExit) as exit_:
        main([*CLI, *flags])
    assert exit_.value.code == 2 and words in capfd.readouterr().err


def test_tour_row():
    """Chapter 09b's 5d-moe row (dp 2 × pp 2 × tp 2, ep 2, top-2 with drops): one device, bytes = formula."""
    from minipar.course.ch09b_five_dimensions_and_moe import tour
    assert dict(tour.STRATEGIES)["5d-moe"] is tour.moe_5d
    row = tour.moe_5d(steps=2)        # 2 Adam steps, not the tour's 3: the moments are read from step 2
    assert row.strategy == "5d-moe" and row.world_size == 8 and row.matches and row.max_abs_diff < 1e-10
    assert row.bytes_sent_per_rank == pytest.approx(row.bytes_formula) and "ep 64.0 KiB (64.0 KiB)" in row.note
    assert row.bytes_sent_per_rank <= row.bytes_observed_per_rank <= 1.5 * row.bytes_formula


def _watched(rank, world_size, recipe, layout):
    from test_device_path import DeviceWatch          # tests/test_device_path.py: factories without device=
    from minipar.hybrid.runner import parallel_train
    with DeviceWatch() as watch:
        parallel_train(rank, world_size, recipe, layout=layout, device="cpu")
    return sorted(set(watch.calls))


def test_every_factory_in_the_moe_path_names_its_device():
    from minipar import launch
    layout = Layout(dp=2, pp=2, ep=2, zero=1, micro_batches=2)
    found = {c for calls in launch(_watched, 4, recipe(layout), layout, quiet=True) for c in calls}
    assert not found, "tensor factories without device= under minipar/:\n" + "\n".join(sorted(found))


def test_reference_with_cp_and_drops_warns_and_the_help_says_so():
    """cp > 1 with cf < E/k: the one-device reference cannot route as the run does; the helper warns, the train
    command's help names the condition, and cp = 1 (routing groups) or cf = E/k stays silent."""
    import warnings
    from minipar.hybrid.cli import build_parser
    from minipar.hybrid.experts import RoutingMismatch
    with pytest.warns(RoutingMismatch, match=r"cp = 2 with capacity factor 1.25 < E/k = 4"):
        recipe(Layout(dp=2, cp=2), capacity_factor=1.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe(Layout(dp=2, cp=2), capacity_factor=float(E))
        recipe(Layout(dp=2), capacity_factor=1.0)
    assert "with --cp > 1 the run equals one device only at cf ≥ E/k" in " ".join(build_parser().format_help().split())


def test_the_issues_command_ep_over_dp_and_tp_equals_plain_dp(capfd):
    """Issue 36: ``train --experts 4 --capacity-factor 4 --dtype float64 --dp 2 --tp 2 --ep 4`` (ep over dp × tp:
    every rank holds one distinct expert) trains as ``--dp 2`` alone does; here with ``--n-layer 2`` (the default 4
    only adds blocks that route as the first two do, at twice the steps' CPU)."""
    import json
    from minipar.hybrid.cli import main
    # 2 steps: the second is the first whose update reads Adam's moments
    base = ["--experts", "4", "--capacity-factor", "4", "--dtype", "float64", "--steps", "2", "--n-layer", "2", "--json"]
    losses = {}
    for layout in (["--dp", "2", "--tp", "2", "--ep", "4"], ["--dp", "2"]):
        capfd.readouterr()
        assert main([*base, *layout]) == 0
        losses[len(layout)] = [json.loads(line)["loss"] for line in capfd.readouterr().out.splitlines()]
    assert len(losses[6]) == 2 and losses[6] == pytest.approx(losses[2], rel=1e-12, abs=1e-12)

"""Context parallelism inside the hybrid trainer (dp × pp × cp × tp, + SP, + ZeRO-1 over dp × cp) equals
single-device training: loss at every step and every parameter after 2 Adam steps (the moments are used from step 2;
a third showed nothing more), float64, compare's tolerance (atol 1e-10, rtol 1e-9; measured max |Δ| ≈ 1.4e-13 at 3
steps). Two layers (one block per stage where pp = 2; the interleaved layout's v = 2 chunks on 2 stages take four):
a stage's second block showed nothing more and cost about a third of each launch. Every method of chapter 06b runs
at least once; the bytes of each kind (now with "cp") equal the formulas;
impossible layouts are refused before launch."""
import pytest
import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.hybrid.parallel3d import bytes_formula, validate
from minipar.hybrid.runner import run
from minipar.layout import Layout

BATCH, SEQ = 8, 16


def recipe(steps=2, n_layer=2, **changes):       # 2 steps, 2 layers: see the docstring
    r = gpt_recipe(steps=steps, batch_size=BATCH, seq_len=SEQ, n_layer=n_layer, n_head=8, **changes)
    r.dtype = torch.float64          # Adam amplifies summation-order rounding in float32
    return r


@pytest.fixture(scope="module")
def reference():
    """{n_layer: the one-device run}, each computed once, when first asked."""
    cache = {}

    def get(n_layer=2):
        if n_layer not in cache:
            cache[n_layer] = train_reference(recipe(n_layer=n_layer))
        return cache[n_layer]
    return get


def layers(fields):
    return 4 if fields.get("schedule") == "interleaved" else 2     # v = 2 chunks on each of pp = 2 stages


LAYOUTS = {      # 8 ranks each
    "dp2 cp2 tp2 ring": dict(dp=2, cp=2, tp=2, schedule="gpipe"),
    "cp2 pp2 tp2 zigzag": dict(cp=2, pp=2, tp=2, cp_method="ring-zigzag"),
    "dp2 cp2 pp2 zero1 ulysses": dict(dp=2, cp=2, pp=2, zero=1, schedule="gpipe", cp_method="ulysses"),
    "cp4 tp2 ulysses": dict(cp=4, tp=2, schedule="gpipe", cp_method="ulysses"),
    "cp2 pp2 tp2 sp zigzag": dict(cp=2, pp=2, tp=2, sp=True, cp_method="ring-zigzag"),
    "dp2 cp2 pp2 rsa": dict(dp=2, cp=2, pp=2, cp_method="rsa"),
    "dp2 cp4 ring": dict(dp=2, cp=4, schedule="gpipe"),
    "cp2 pp2 tp2 interleaved ring": dict(cp=2, pp=2, tp=2, schedule="interleaved", v=2),
    "dp2 cp2 tp2 sp zero1 ulysses": dict(dp=2, cp=2, tp=2, sp=True, zero=1, schedule="gpipe",
                                         cp_method="ulysses"),
    "cp2 pp2 tp2 recompute zigzag": dict(cp=2, pp=2, tp=2, recompute="full", cp_method="ring-zigzag"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_device(reference, name):
    layout = Layout(**LAYOUTS[name], micro_batches=2)
    assert layout.world_size == 8
    n_layer = layers(LAYOUTS[name])
    runs = run(recipe(n_layer=n_layer), layout=layout)
    compare(reference(n_layer), runs, dtype=torch.float64).assert_ok()
    cfg = recipe(n_layer=n_layer).model().cfg
    for r in runs:                    # bytes per kind: the communication log equals the formula on every rank
        want = bytes_formula(cfg, batch=BATCH, seq=SEQ, layout=layout, pp_rank=r.coords["pp"])
        assert set(want) == {"dp", "pp", "tp", "cp"} and want["cp"] > 0
        assert r.bytes_by_kind == pytest.approx(want)


def _gradients_over_dp_only(rank, world_size, recipe, layout):
    """The trainer with one plausible bug: gradients averaged over the dp group only, not over dp × cp."""
    from minipar.check import RunResult
    from minipar.data.ddp import Reducer
    from minipar.hybrid.parallel3d import Trainer3D
    t = Trainer3D(rank, world_size, recipe, layout=layout)
    t.reducer = Reducer(t.params, t.mesh.group("dp"))
    losses = [t.step(x, y, i) for i, (x, y) in enumerate(recipe.batches)]
    return RunResult(losses if losses[0] is not None else None, t.full_params())


def test_the_comparison_sees_gradients_not_reduced_over_cp(reference):
    """Not a test that cannot fail: the same comparison refuses a run whose cp ranks keep their own gradients."""
    from minipar import launch
    layout = Layout(dp=2, cp=2, tp=2, schedule="gpipe", micro_batches=2)
    runs = launch(_gradients_over_dp_only, 8, recipe(), layout, quiet=True)
    comparison = compare(reference(), runs, dtype=torch.float64)
    assert not comparison.matches and comparison.max_abs_diff > 1e-6, str(comparison)
    print(comparison)


@pytest.mark.parametrize("fields, words", [
    (dict(cp=2, tp=2, dp=2, cp_method="striped"), "unknown context-parallel method 'striped'"),
    (dict(cp=3, tp=2, dp=1, cp_method="ring"), "divisible by 3"),
    (dict(cp=4, tp=2, cp_method="ring-zigzag", seq=12), "2N = 8"),
    (dict(cp=4, tp=4, cp_method="ulysses"), "divisible by cp · tp = 16"),
    (dict(cp=2, tp=4, sp=True, cp_method="ring", seq=12), "divisible by cp · tp = 8"),
    (dict(cp=2, tp=2, dp=2, dropout=0.1), "dropout"),
    (dict(cp=2, tp=2, dp=2, ep=2), "ep=2: expert parallelism needs a mixture-of-experts model"),
    (dict(cp=2, tp=2, dp=2, world_size=16), "has 8 ranks but world_size is 16"),
    (dict(cp=4, tp=2, cp_method="ring-zigzag"), None),
    (dict(cp=4, tp=2, cp_method="ulysses"), None),
])
def test_validate(fields, words):
    seq, dropout = fields.pop("seq", SEQ), fields.pop("dropout", 0.0)
    world = fields.pop("world_size", None)
    r = gpt_recipe(steps=1, batch_size=BATCH, seq_len=seq, n_layer=4, n_head=8, dropout=dropout)
    layout = Layout(**fields, micro_batches=2, schedule="gpipe")
    if words is None:
        validate(r, layout=layout, world_size=world)
        return
    with pytest.raises(ValueError, match=words):
        validate(r, layout=layout, world_size=world)


def test_run_validates_before_starting(monkeypatch):
    monkeypatch.setattr("minipar.launcher.launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match="2N = 8"):
        run(gpt_recipe(steps=1, batch_size=BATCH, seq_len=12, n_layer=4, n_head=8),
            layout=Layout(cp=4, tp=2, cp_method="ring-zigzag", micro_batches=2, schedule="gpipe"))


CLI = ["--batch-size", "8", "--seq-len", "16", "--micro-batches", "2", "--dtype", "float64", "--steps", "2",
       "--schedule", "gpipe", "--json"]


def _losses(capfd, *flags):
    from minipar.hybrid.cli import main
    import json
    capfd.readouterr()
    assert main([*flags, *CLI]) == 0
    out, err = capfd.readouterr()
    return [json.loads(line)["loss"] for line in out.splitlines()], err


def test_train_command_with_cp_equals_one_device(capfd):
    one, _ = _losses(capfd)
    cp, err = _losses(capfd, "--dp", "2", "--cp", "2", "--tp", "2", "--cp-method", "ring-zigzag")
    assert len(one) == len(cp) == 2 and err.count("step    1/") == 1      # one reporter, not one per cp rank
    assert cp == pytest.approx(one, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("flags, words", [
    (["--cp", "4", "--tp", "2", "--cp-method", "ulysses"], "divisible by cp · tp = 8"),
    (["--cp", "0"], "--cp must be a positive integer"),
    (["--cp", "2", "--cp-method", "striped"], "invalid choice"),
])
def test_train_command_refuses_before_launch(capfd, monkeypatch, flags, words):
    from minipar.hybrid.cli import main
    monkeypatch.setattr("minipar.launcher.launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(SystemExit) as exit_:
        main([*flags, *CLI])
    assert exit_.value.code == 2 and words in capfd.readouterr().err

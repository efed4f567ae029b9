"""Dropless MoE in the 5D trainer and the train command: ``train --experts 8 --ep 4 --dropless`` trains as the same
command without ``--ep`` and as one device; a dp × pp × tp layout with ep folded over tp equals one device
(float64), with every kind's bytes but the data-dependent ep equal to the formula; ``--dropless`` without experts
is refused before any process starts. Each equality trains 2 steps (Adam's moments are read from step 2; the
loss-free bias moved after step 1 routes step 2); the resume test keeps 3 (a save at step 1, then steps 2 and 3)."""
import json

import pytest
import torch

from minipar.check import compare, train_reference
from minipar.hybrid.experts import hybrid_moe_recipe
from minipar.hybrid.parallel3d import bytes_formula
from minipar.hybrid.runner import run
from minipar.layout import Layout

BASE = ["--experts", "8", "--top-k", "2", "--capacity-factor", "1.0", "--dropless", "--dtype", "float64",
        "--steps", "2", "--batch-size", "8", "--seq-len", "8", "--micro-batches", "2", "--n-layer", "2",
        "--n-embd", "16", "--json"]


def _losses(capfd, flags):
    from minipar.hybrid.cli import main
    capfd.readouterr()
    assert main(flags) == 0
    return [json.loads(line)["loss"] for line in capfd.readouterr().out.splitlines()]


def test_train_dropless_with_ep_equals_the_command_without_ep_and_one_device(capfd):
    from minipar.hybrid.cli import build_parser, make_recipe
    with_ep, without = [*BASE, "--dp", "4", "--ep", "4"], [*BASE, "--dp", "4"]
    ref = train_reference(make_recipe(build_parser().parse_args(with_ep)))
    assert make_recipe(build_parser().parse_args(with_ep)).model().moe.dropless
    a, b = _losses(capfd, with_ep), _losses(capfd, without)
    assert len(a) == 2 and a == pytest.approx(b, rel=1e-12, abs=1e-12)
    assert a == pytest.approx(ref.losses, rel=1e-12, abs=1e-12)


def test_dropless_layout_folded_over_tp_equals_one_device():
    layout = Layout(dp=2, pp=2, tp=2, ep=4, micro_batches=2)
    r = hybrid_moe_recipe(layout, steps=2, batch_size=8, seq_len=8, experts=4, k=2, capacity_factor=1.0,
                          n_layer=2, n_head=4, n_embd=16, dropless=True)
    runs = run(r, layout=layout)
    compare(train_reference(r), runs, dtype=torch.float64).assert_ok()
    model = r.model()
    for res in runs:
        want = bytes_formula(model.cfg, batch=8, seq=8, layout=layout, pp_rank=res.coords["pp"], moe=model.moe)
        assert set(res.bytes_by_kind) == set(want)
        assert {k: v for k, v in res.bytes_by_kind.items() if k != "ep"} == \
            pytest.approx({k: v for k, v in want.items() if k != "ep"})
    # ep: the rows really routed. Over ranks, rows sent = rows received, so the mean is at most every row leaving its
    # rank, m·L·(4·k·T·h·b + counts) (T = 8 tokens per tp rank, L = 1 MoE layer per stage), below what padded layers
    # at the no-drop capacity C = T would send, m·L·4·(ep−1)/ep·E·T·h·b
    mean = sum(res.bytes_by_kind["ep"] for res in runs) / len(runs)
    assert 0 < mean <= 2 * (4 * 2 * 8 * 16 * 8 + 3 / 4 * 4 * 8) < 2 * 4 * 3 / 4 * 4 * 8 * 16 * 8


def test_dropless_without_experts_is_refused_before_launch(capfd, monkeypatch):
    from minipar.hybrid.cli import main
    monkeypatch.setattr("minipar.launcher.launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(SystemExit) as exit_:
        main(["--dropless", "--steps", "1"])
    assert exit_.value.code == 2 and "--dropless needs an MoE model" in capfd.readouterr().err


def _loss_free(layout, **moe):
    """The hybrid MoE recipe with loss-free balancing (γ = 0.05, a bias buffer moved after every step)."""
    from dataclasses import replace
    from minipar.moe.layer import MoEGPT
    r = hybrid_moe_recipe(layout, steps=2, batch_size=8, seq_len=8, experts=4, n_layer=2, n_head=4, n_embd=16, **moe)
    base = r.model()
    cfg, config = base.cfg, replace(base.moe, bias_rate=0.05)
    r.model = lambda: MoEGPT(cfg, config)
    return r


@pytest.mark.parametrize("fields, moe", [
    (dict(dp=2, pp=2, tp=2, ep=2), dict(k=2, capacity_factor=1.0, shared=1, granularity=2)),
    (dict(dp=2, tp=2, ep=4, pp=2), dict(k=1, capacity_factor=1.0, shared=1, dropless=True)),
])
def test_shared_fine_grained_loss_free_layouts_equal_one_device(fields, moe):
    from minipar.moe.expert_parallel import loss_free_reference
    layout = Layout(**fields, micro_batches=1, schedule="gpipe")
    r = _loss_free(layout, **moe)
    reference, biases = loss_free_reference(r)
    assert any(b.abs().max() > 0 for b in biases)                 # the bias really moved
    runs = run(r, layout=layout)
    compare(reference, runs, dtype=torch.float64).assert_ok()
    model = r.model()
    shared = {n for n, _ in model.named_parameters() if ".shared." in n}
    assert shared and shared <= {n for res in runs for n in res.params}   # the shared experts, under their names
    for res in runs:                    # every kind's bytes = the formula (dropless: all but the ep exchange)
        want = bytes_formula(model.cfg, batch=8, seq=8, layout=layout, pp_rank=res.coords["pp"], moe=model.moe)
        skip = {"ep"} if model.moe.dropless else set()
        assert {k: v for k, v in res.bytes_by_kind.items() if k not in skip} == \
            pytest.approx({k: v for k, v in want.items() if k not in skip}), res.coords


def test_loss_free_with_micro_batches_is_refused():
    from minipar.hybrid.parallel3d import validate
    layout = Layout(dp=2, ep=2, micro_batches=2)
    with pytest.raises(ValueError, match="loss-free balancing moves its bias from one forward's load"):
        validate(_loss_free(layout), layout=layout)


def test_a_checkpoint_identity_names_the_moe_shape_and_refuses_a_loss_free_bias():
    from minipar.hybrid.guard import run_identity
    from minipar.models import GPTConfig
    from minipar.moe.layer import MoEConfig
    cfg = GPTConfig(n_layer=1, n_embd=16, n_head=2)
    plain = run_identity(cfg, seed=0, dtype="float64", data={}, moe=MoEConfig())["config"]
    shaped = run_identity(cfg, seed=0, dtype="float64", data={}, moe=MoEConfig(shared=1, granularity=2, dropless=True))
    assert not any(k in plain for k in ("moe_shared", "moe_granularity", "moe_dropless"))
    assert {k: shaped["config"][k] for k in ("moe_shared", "moe_granularity", "moe_dropless")} == \
        {"moe_shared": 1, "moe_granularity": 2, "moe_dropless": True}
    with pytest.raises(ValueError, match="routing biases are not saved in a checkpoint yet"):
        run_identity(cfg, seed=0, dtype="float64", data={}, moe=MoEConfig(bias_rate=1e-3))


SHAPED = ["--experts", "4", "--top-k", "2", "--capacity-factor", "1.0", "--dtype", "float64", "--steps", "2",
          "--batch-size", "8", "--seq-len", "8", "--n-layer", "2", "--n-embd", "16", "--json", "--dp", "2"]


def test_train_shared_fine_grained_with_ep_equals_the_command_without_ep_and_one_device(capfd):
    from minipar.hybrid.cli import build_parser, make_recipe
    flags = [*SHAPED, "--micro-batches", "2", "--shared-experts", "1", "--granularity", "2"]
    model = make_recipe(build_parser().parse_args(flags)).model()
    assert (model.moe.shared, model.moe.granularity) == (1, 2)
    assert any(".shared.0." in n for n, _ in model.named_parameters())
    a, b = _losses(capfd, [*flags, "--ep", "2"]), _losses(capfd, flags)
    assert len(a) == 2 and a == pytest.approx(b, rel=1e-12, abs=1e-12)
    assert a == pytest.approx(train_reference(make_recipe(build_parser().parse_args(flags))).losses, rel=1e-12, abs=1e-12)


def test_train_loss_free_with_ep_equals_the_command_without_ep_and_one_device(capfd):
    """``--bias-rate``: the bias moved after every step; one device moves it too (loss_free_reference)."""
    from minipar.hybrid.cli import build_parser, make_recipe
    from minipar.moe.expert_parallel import loss_free_reference
    flags = [*SHAPED, "--micro-batches", "1", "--bias-rate", "0.05"]
    reference, biases = loss_free_reference(make_recipe(build_parser().parse_args(flags)))
    assert any(b.abs().max() > 0 for b in biases)                 # the bias really moved
    a, b = _losses(capfd, [*flags, "--ep", "2"]), _losses(capfd, flags)
    assert len(a) == 2 and a == pytest.approx(b, rel=1e-12, abs=1e-12)
    assert a == pytest.approx(reference.losses, rel=1e-12, abs=1e-12)


def test_a_resume_with_other_shared_or_granularity_is_refused_and_the_same_resumes(capfd, monkeypatch, tmp_path):
    from minipar.hybrid.cli import main
    flags = [*SHAPED, "--micro-batches", "2", "--shared-experts", "1", "--granularity", "2"]
    flags[flags.index("--steps") + 1] = "3"           # 3 steps here: save after step 1, resume steps 2 and 3
    assert len(_losses(capfd, [*flags[:flags.index("--steps") + 1], "1", *flags[flags.index("--steps") + 2:],
                               "--save", str(tmp_path)])) == 1
    monkeypatch.setattr("minipar.launcher.launch", lambda *a, **k: pytest.fail("a process was started"))
    for other, says in ((["--granularity", "1"], "config.moe_granularity: checkpoint 2, this run '(not recorded)'"),
                        (["--shared-experts", "0"], "config.moe_shared: checkpoint 1, this run '(not recorded)'")):
        with pytest.raises(SystemExit) as exit_:
            main([*flags, *other, "--resume", str(tmp_path)])
        assert exit_.value.code == 2 and says in capfd.readouterr().err
    monkeypatch.undo()
    assert len(_losses(capfd, [*flags, "--resume", str(tmp_path)])) == 2          # steps 2 and 3

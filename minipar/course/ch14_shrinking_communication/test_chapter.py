"""Chapter 14's helpers: the one-launch study gives the library study's rows; the shapes, collectives and
bytes the cluster model prices are the library's formulas; the generated sentences follow the numbers."""
import math

import pytest

from minipar.comm import predicted_bytes_sent
from minipar.check import gpt_recipe
from minipar.course.ch14_shrinking_communication.compression_study import loss_vs_bytes, study_recipe
from minipar.data.powersgd import powersgd_bytes
from minipar.models import GPTConfig
from minipar.machine.cluster import a100_cluster
from minipar.course.ch14_shrinking_communication import study as s14


STUDY = dict(steps=10, ranks=(1, 2), Hs=(5, 10), fragments=2)


@pytest.fixture(scope="module")
def library():
    """The library's study on 2 ranks, once for the two tests that read it."""
    return loss_vs_bytes(world_size=2, **STUDY)


def test_one_launch_gives_the_library_study_s_rows(library):
    ours = s14.train_every_method(world=2, tuned_lr=None, with_zeropp=False, **STUDY)
    assert [name for name, _, _ in library][:4] == list(ours.runs)[:4]
    for (name, sent, loss), run in zip(library, ours.runs.values()):
        assert run.total_bytes == sent, name
        assert math.isclose(run.held_out, loss, rel_tol=1e-9), (name, run.held_out, loss)
    assert len(library) == len(ours.runs)
    rows = s14.points(ours)
    assert rows[1][0] == "ZeRO-3" and rows[1][1] == 1.5 * rows[0][1] and rows[1][2] == rows[0][2]


@pytest.mark.parametrize("cfg", [GPTConfig(n_layer=2, n_embd=16, n_head=2), GPTConfig(n_layer=3, n_embd=24, n_head=4,
                                                                                 vocab_size=40, block_size=12)])
def test_gpt_shapes_are_the_model_s(cfg):
    model_cfg = {k: getattr(cfg, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size")}
    shapes = [tuple(p.shape) for p in gpt_recipe(**model_cfg).model().parameters()]
    assert s14.gpt_shapes(cfg) == shapes


def test_collectives_carry_each_method_s_formula():
    shapes = s14.gpt_shapes(GPTConfig(n_layer=2, n_embd=64, n_head=4))
    n, b = 16, 4
    psi = b * sum(math.prod(s) for s in shapes)
    sent = {m: sum(calls * predicted_bytes_sent(op, payload, n) for op, payload, calls in cs)
            for m, cs in s14.collectives_per_step(shapes, b).items()}
    assert sent["DDP"] == predicted_bytes_sent("all_reduce", psi, n)
    assert math.isclose(sent["ZeRO-3"], 1.5 * sent["DDP"])
    for r in s14.RANKS:
        assert math.isclose(sent[f"PowerSGD r={r}"], powersgd_bytes(shapes, r, n, b))
    for H in s14.HS:
        assert math.isclose(sent[f"DiLoCo H={H}"], sent["DDP"] / H)


def test_across_nodes_costs_more_than_inside_a_node():
    collectives = s14.collectives_per_step(s14.gpt_shapes(GPTConfig(n_layer=4, n_embd=512, n_head=8)), 4)
    across = s14.step_seconds(collectives, a100_cluster(2), 16)
    inside = s14.step_seconds(collectives, a100_cluster(1), 8)
    assert all(across[m] > inside[m] for m in collectives)


def test_reading_follows_the_numbers(capsys):
    rows = [("DDP", 10, 2.0, True), ("ZeRO-3", 15, 2.0, False), ("DDP lr 0.01", 10, 1.5, True),
            ("PowerSGD r=1", 1, 2.5, True), ("PowerSGD r=2", 2, 2.6, True), ("DiLoCo H=10", 1, 1.4, True)]
    s14.print_reading(rows)
    out = capsys.readouterr().out
    assert "does not fall with the rank" in out and "2 of 2 end above" in out
    assert "DiLoCo H=10: 1.400, below DDP" in out and "DDP lr 0.01: 1.500, above DiLoCo H=10" in out


def test_loss_vs_bytes_rows_carry_each_methods_formula(library):
    # the study above (10 steps: DiLoCo H=5 syncs twice, H=10 and its streaming fragments once each)
    steps = STUDY["steps"]
    rows = {m: (sent, loss) for m, sent, loss in library}
    shapes = [p.shape for p in study_recipe(steps)[0].model().parameters()]
    param_bytes = 4 * sum(s.numel() for s in shapes)             # N = 2: 2(N−1)/N = 1
    assert rows["DDP"][0] == steps * param_bytes
    assert rows["PowerSGD r=1"][0] == steps * powersgd_bytes(shapes, 1, 2, 4)
    assert rows["DiLoCo H=5"][0] == steps // 5 * param_bytes
    assert rows["DiLoCo H=10"][0] == rows["Streaming DiLoCo H=10 F=2"][0] == steps // 10 * param_bytes
    assert all(0 < loss < 5 for _, loss in rows.values())

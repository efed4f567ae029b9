"""The analytic calculator against the ZeRO paper's own numbers (Figure 1: Ψ = 7.5 B, N = 64, K = 12)."""
import pytest

from minipar.data.zero_memory import (GB, GiB, PRECISIONS, Precision, bytes_sent_per_step, fmt, model_state_bytes_formula,
                                      padded_numel, table)


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_figure_1(stage, gb):
    total = model_state_bytes_formula(7.5e9, 64, stage, "mixed")["total"]
    assert total / GB == pytest.approx(gb, abs=0.05)


def test_formulas_term_by_term():
    psi, n = 1000, 4
    assert model_state_bytes_formula(psi, n, 0) == {"params": 2000, "grads": 2000, "optimizer": 12000, "total": 16000}
    assert model_state_bytes_formula(psi, n, 1)["optimizer"] == 12 * psi / n
    assert model_state_bytes_formula(psi, n, 2)["grads"] == 2 * psi / n
    assert model_state_bytes_formula(psi, n, 3)["params"] == 2 * psi / n
    fp32 = model_state_bytes_formula(psi, n, 0, "fp32")
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    assert model_state_bytes_formula(psi, n, 1, Precision(2, 4, 12))["grads"] == 4 * psi


def test_one_rank_shards_nothing():
    for stage in range(4):
        assert model_state_bytes_formula(10, 1, stage) == model_state_bytes_formula(10, 1, 0)


def test_communication_stage3_is_one_and_a_half_ddp():
    for prec in PRECISIONS:
        ddp = bytes_sent_per_step(1e9, 8, 0, prec)
        assert ddp == 2 * PRECISIONS[prec].grad * 1e9 * 7 / 8
        assert bytes_sent_per_step(1e9, 8, 1, prec) == bytes_sent_per_step(1e9, 8, 2, prec) == ddp
        assert bytes_sent_per_step(1e9, 8, 3, prec) == pytest.approx(1.5 * ddp)
    assert bytes_sent_per_step(1e9, 1, 3) == 0


def test_padding_and_units():
    assert padded_numel([42, 24], 4) == 44 + 24
    assert fmt(1.2e11) == "120.0 GB" and fmt(GiB, "GiB") == "1.0 GiB" and fmt(GiB) == "1.1 GB"
    assert "ZeRO-3" in table(7.5e9, 64)


def test_bad_input():
    with pytest.raises(ValueError, match="stage"):
        model_state_bytes_formula(1, 2, 4)
    with pytest.raises(ValueError, match="N"):
        model_state_bytes_formula(1, 0, 1)
    with pytest.raises(ValueError, match="precision"):
        model_state_bytes_formula(1, 2, 1, "fp8")

"""Chapter 12's memory-and-time calculator (figures.calculate / calculator_controls) takes cp, ep and overlap."""
import pytest

from minipar.course.ch12_choosing_a_strategy import figures as fig12
from minipar.plan import Layout, a100_cluster, estimate


def test_default_view_is_the_chapters():
    e = fig12.calculate()
    assert e.fits and e.layout.devices == 1024 and 0.3 < e.mfu < 0.7
    assert e.layout == Layout(dp=8, tp=8, pp=16, zero=1, sp=True, recompute="selective", micro_batches=192)


def test_cp_ep_and_overlap_reach_the_estimate():
    moe = fig12.calculate(model="MoE 1.3B × 8 experts", dp=8, tp=2, pp=1, ep=4, micro_batches=8, overlap=True)
    assert moe.layout.ep == 4 and moe.bytes_sent["ep"] > 0 and moe.hidden["dp"] > 0
    assert moe.step_seconds == estimate(fig12.CALCULATOR_MODELS["MoE 1.3B × 8 experts"], a100_cluster(2), moe.layout,
                                        overlap=True).step_seconds
    uly = fig12.calculate(model="GPT 13B", seq_len=32768, dp=2, cp=2, cp_method="ulysses", tp=4, pp=4, micro_batches=8)
    assert uly.layout.cp == 2 and uly.layout.cp_method == "ulysses" and uly.bytes_sent["cp"] > 0
    with pytest.raises(ValueError, match="mixture-of-experts"):
        fig12.calculate(model="GPT 13B", dp=2, ep=2)


def test_controls_enable_what_applies():
    pytest.importorskip("ipywidgets")
    ctl = fig12.calculator_controls()
    assert ctl["cp_method"].disabled and ctl["ep"].disabled and ctl["v"].disabled
    ctl["cp"].value, ctl["model"].value, ctl["schedule"].value = 4, "MoE 1.3B × 8 experts", "interleaved"
    assert not (ctl["cp_method"].disabled or ctl["ep"].disabled or ctl["v"].disabled)
    assert set(ctl) - {"overlap"} <= set(fig12.calculate.__code__.co_varnames) and "overlap" in ctl

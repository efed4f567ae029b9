"""The hybrid trainer on 16 ranks (dp 2 × pp 2 × cp 2 × tp 2 and kin) equals single-device training: the loss
at every step and every parameter after 2 Adam steps (Adam's moments are used from step 2; a third step showed
nothing more and cost a 16-rank step per layout), float64, compare's tolerance (atol 1e-10, rtol 1e-9;
measured max |Δ| ≈ 5e-14). Each context-parallel method runs once (ring-zigzag, Ulysses with SP, RSA, ring),
one layout with ZeRO-1 over dp × cp, and one with all five dimensions > 1: dp 2 × cp 2 × pp 2 × tp 2 with ep = 2
folded into dp × cp (the MoE GPT of :func:`~minipar.hybrid.experts.hybrid_moe_recipe`, no-drop capacity as cp > 1
needs; measured 2.8 to 3.1 s, max |Δ| ≈ 2e-13). On every rank the bytes of each kind (dp × cp, pp, cp, tp; + ep, edp,
balance) equal ``bytes_formula``, and every rank reports its memory (model states and peak), ZeRO-1's beside its
formula.

Two layers, one block per pipeline stage (pp = 2), except the interleaved layout's four (v = 2 chunks on each of 2
stages): 4 layers cost 1.7× the CPU of 2 and showed nothing more (a 16-rank launch, memory tracked: ZeRO-1 RSA
16.2 / 12.8 CPU-s at 4 layers, 8.8 / 7.6 at 2; the MoE layout 20.7 against 13.0). Ring-zigzag on
dp 2 × cp 2 × pp 2 × tp 2 with 1F1B, chapter 09b's tour-row layout, is asserted on that row's own launch (equal to
one device, bytes = formula on every rank, peak > model states) by ``test_5d_tour_row``
(minipar/course/ch09b_five_dimensions_and_moe/test_chapter.py): a second 16-rank launch of it here cost 16 CPU-s.

One launch per layout, 16 processes on this machine's 2 cores: about 2 to 2.5 s each when it is quiet
(measured 2.4, 2.0, 2.3, 2.2 s, at 4 layers); each case prints its time. A layout line takes recipe changes too, so a
MoE layout (``ep=2`` folded into dp × cp, a MoE recipe: ``experts`` among the changes) is one line of
:data:`LAYOUTS`. The seconds and max |Δ| quoted here were measured at 3 steps."""
import time

import pytest
import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.hybrid.experts import hybrid_moe_recipe
from minipar.hybrid.parallel3d import bytes_formula
from minipar.hybrid.runner import run
from minipar.layout import Layout

BATCH, SEQ = 8, 8
WORLD = 16


def recipe(steps=2, layout=None, n_layer=2, **changes):   # 2 steps, 2 layers: see the docstring
    if "experts" in changes:         # the MoE GPT of this layout's dp and m (its one-device loss)
        return hybrid_moe_recipe(layout, steps=steps, batch_size=BATCH, seq_len=SEQ, n_layer=n_layer, n_head=4,
                                 **changes)
    r = gpt_recipe(steps=steps, batch_size=BATCH, seq_len=SEQ, n_layer=n_layer, n_head=4, **changes)
    r.dtype = torch.float64          # Adam amplifies summation-order rounding in float32
    return r


# name: (layout fields, recipe changes); 16 ranks each, m = 2
LAYOUTS = {
    # dp2 cp2 pp2 tp2 ring-zigzag 1F1B: asserted on chapter 09b's tour row launch (test_5d_tour_row; docstring)
    "dp2 cp2 pp2 tp2 sp ulysses gpipe": (dict(dp=2, cp=2, pp=2, tp=2, sp=True, cp_method="ulysses",
                                              schedule="gpipe"), {}),
    "dp2 cp2 pp2 tp2 zero1 rsa": (dict(dp=2, cp=2, pp=2, tp=2, zero=1, cp_method="rsa"), {}),
    "cp4 pp2 tp2 interleaved ring": (dict(cp=4, pp=2, tp=2, schedule="interleaved", v=2), dict(n_layer=4)),
    # all five > 1: ep = 2 folded into dp × cp; cp > 1 compares at no-drop capacity (cf = E/k); an MoE layer a stage
    "dp2 cp2 pp2 tp2 ep2 moe zigzag": (dict(dp=2, cp=2, pp=2, tp=2, ep=2, cp_method="ring-zigzag"),
                                       dict(experts=4, k=1, capacity_factor=4.0)),
}


@pytest.fixture(scope="module")
def runs():
    """{layout name: (Layout, per-rank HybridRun, seconds)}, each layout launched once, when first asked."""
    cache, references = {}, {}

    def get(name):
        if name not in cache:
            fields, changes = LAYOUTS[name]
            layout = Layout(**fields, micro_batches=2)
            assert layout.world_size == WORLD
            key = tuple(sorted(changes.items()))
            if key not in references:
                references[key] = train_reference(recipe(layout=layout, **changes))
            start = time.perf_counter()
            result = run(recipe(layout=layout, **changes), layout=layout, track_memory=True)
            cache[name] = (layout, result, time.perf_counter() - start, references[key])
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_device(runs, name):
    layout, result, seconds, reference = runs(name)
    comparison = compare(reference, result, dtype=torch.float64)
    print(f"{name}: {WORLD} ranks, {seconds:.1f} s, max |Δ| {comparison.max_abs_diff:.1e}")
    comparison.assert_ok()
    assert comparison.max_abs_diff < 1e-10
    model = recipe(layout=layout, **LAYOUTS[name][1]).model()
    kinds = ("dp", "pp", "tp", "cp") + (("ep", "edp", "balance") if layout.ep > 1 else ())
    for r in result:                  # bytes per kind: the communication log equals the formula on every rank
        want = bytes_formula(model.cfg, batch=BATCH, seq=SEQ, layout=layout, pp_rank=r.coords["pp"],
                             moe=getattr(model, "moe", None))
        assert set(kinds) <= set(want) and all(want[k] > 0 for k in kinds)
        assert set(r.bytes_by_kind) == set(want) and r.bytes_by_kind == pytest.approx(want)
        assert r.peak_bytes > r.model_state_bytes > 0           # memory per rank: reported, and states are in it


def test_zero1_over_dp_x_cp_holds_a_quarter_of_adam(runs):
    """Model states per rank, measured: plain 4·b·Ψ_r + 4 bytes per Adam step count (params, grads, two
    moments); ZeRO-1 over the dp × cp = 4 ranks keeps 2·b·Ψ_r + 2·b·Ψ_r/4 (+ one step count per stage).
    Ψ_r comes out of the plain run (the same dp × cp × pp × tp, without ZeRO; SP and the cp method shard no
    parameter); the ZeRO-1 run must hold what the formula says for it."""
    _, plain, _, _ = runs("dp2 cp2 pp2 tp2 sp ulysses gpipe")
    layout, zero1, _, _ = runs("dp2 cp2 pp2 tp2 zero1 rsa")
    d, b = layout.dp * layout.cp, 8
    for p, z in zip(plain, zero1):
        assert p.coords == z.coords
        psi = (p.model_state_bytes - 4 * len(p.params)) / (4 * b)     # one step count per parameter tensor
        assert psi == int(psi) and psi % d == 0                       # so ZeRO-1 needs no padding here
        assert z.model_state_bytes == 2 * b * psi + 2 * b * psi / d + 4, (p.coords, z.model_state_bytes)
        if p.coords["dp"] == p.coords["cp"] == p.coords["tp"] == 0:        # one line per stage
            print(p.coords, f"plain {p.model_state_bytes} B, ZeRO-1 {z.model_state_bytes} B, peak {z.peak_bytes} B")

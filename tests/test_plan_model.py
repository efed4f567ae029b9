"""minipar.plan.model against the papers' own tables.

Where a published number is rounded, the test allows exactly that rounding (half a unit of its last digit)
and says so. The tables as printed in the papers (values typed from them):

* Narayanan et al. 2021 (Megatron-LM, SC'21), Table 1: parameters in billions, printed to 0.1 B.
* Korthikanti et al. 2022, Table 2 (activation bytes per layer, closed forms), Table 3 (configs),
  Table 5 (iteration times in s, printed to 0.01 s; MFU and HFU in %, printed to 0.1 %).
* Rajbhandari et al. 2020 (ZeRO), Table 1: GB per device for the 7.5B model, printed to 3 significant digits.
"""
import pytest

from minipar.models import GPTConfig, TinyGPT
from minipar.plan import (GPT3_175B, Transformer, activation_bytes_per_layer, hardware_flops, hfu, mfu,
                          model_flops, model_state_bytes_formula, parameters)

V, S = 51200, 2048

# (published billions, heads, hidden, layers) — Narayanan et al. 2021, Table 1
# Source check (issue 18): the rows were typed from memory. Confirmed from a source: vocabulary 51,200 and
# sequence 2048 for every row, the range 1.7 B to 1 T on up to 3072 GPUs, the 145 B row's model-parallel
# size 64 (TP 8 × PP 8) (NVIDIA/Megatron-LM README, 2021, whose model table is an image of this one), and
# the 1 T row's 52 % of peak on 3072 GPUs (the paper's abstract). NOT confirmed from a source: the
# per-row heads, hidden sizes, layers and printed billions (the table itself was not found as text). They
# are consistent with Eq. 2 to the 0.1 B the table prints, which is what this test checks.
MEGATRON_TABLE_1 = [(1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
                    (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80),
                    (310.1, 128, 16384, 96), (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128)]


@pytest.mark.parametrize("billions, heads, hidden, layers", MEGATRON_TABLE_1)
def test_parameters_reproduce_megatron_table_1(billions, heads, hidden, layers):
    model = Transformer(layers, hidden, heads, V, S)
    p = parameters(model)
    # Eq. 2 exactly
    eq2 = 12 * layers * hidden ** 2 * (1 + 13 / (12 * hidden) + (V + S) / (12 * layers * hidden))
    assert p == pytest.approx(eq2, rel=1e-12)
    assert abs(p / 1e9 - billions) <= 0.05 + 1e-9          # printed to 0.1 B


def test_parameters_count_tinygpt_exactly():
    for cfg in (GPTConfig(), GPTConfig(n_layer=3, n_embd=64, block_size=64), GPTConfig(tie_weights=True)):
        numel = sum(p.numel() for p in TinyGPT(cfg).parameters())
        assert parameters(Transformer.from_config(cfg, seq_len=16)) == numel


# Korthikanti et al. 2022, Table 2: activation bytes per layer, s b h (...)
# Source check (issue 18): all five rows with a closed form (no parallelism, TP, TP + SP, TP + selective,
# TP + SP + selective) and the full-recompute 2sbh are confirmed, character for character, by independent
# write-ups quoting the paper (AWS Neuron's "Activation Memory Reduction" guide for sbh(34 + 5as/h); lecture
# notes and course pages reproducing the table's rows). The paper's own text was not found.
TABLE_2 = {
    ("none", 1, False): lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h),
    ("none", 8, False): lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
    ("none", 8, True): lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t)),
    ("selective", 8, False): lambda s, b, h, a, t: s * b * h * (10 + 24 / t),
    ("selective", 8, True): lambda s, b, h, a, t: s * b * h * 34 / t,
    ("full", 1, False): lambda s, b, h, a, t: 2 * s * b * h,
}


@pytest.mark.parametrize("key", list(TABLE_2))
@pytest.mark.parametrize("model, b", [(GPT3_175B, 1), (Transformer(48, 6144, 64, V, S), 4),
                                      (Transformer(105, 20480, 128, V, S), 1)])
def test_activations_reproduce_korthikanti_table_2(key, model, b):
    recompute, t, sp = key
    got = activation_bytes_per_layer(model, b, tp=t, sp=sp, recompute=recompute)
    want = TABLE_2[key](model.seq_len, b, model.hidden, model.heads, t)
    assert got == pytest.approx(want, rel=1e-12)


def test_gpt3_activations_per_layer_in_gb():
    # s b h (34 + 5as/h) for GPT-3 with b = 1: 2048·12288·(34 + 5·96·2048/12288) = 2.87 GB per layer
    assert activation_bytes_per_layer(GPT3_175B, 1) / 1e9 == pytest.approx(2.868, abs=1e-3)


# Korthikanti et al. 2022, Table 3 (configs) and Table 5 (selective recompute + sequence parallelism)
# Source check (issue 18): the MFU and HFU of every row ARE confirmed from a source — the NVIDIA/Megatron-LM
# README's utilization table ("22B 41.5% 43.7%, 175B 51.4% 52.8%, 530B 56.0% 57.0%, 1T 56.3% 57.0%", found
# as text through the workplace's code search, which points to the paper for how they are computed). NOT
# confirmed: the configurations (Table 3) and the iteration times, typed from memory — neither table was
# found as text. The paper's abstract quotes another run (530 B on 2240 A100s, 54.2 % MFU, 42.1 % with full
# recomputation), not a row of this table. So this test checks typed times against confirmed MFU/HFU
# through the FLOP formulas, and the HFU/MFU ratios check the selective-recompute FLOP count alone.
# name: (heads, hidden, layers, GPUs, global batch, iteration s, MFU %, HFU %)
TABLE_5 = {"22B": (64, 6144, 48, 8, 4, 1.10, 41.5, 43.7), "175B": (96, 12288, 96, 64, 64, 13.75, 51.4, 52.8),
           "530B": (128, 20480, 105, 280, 280, 37.83, 56.0, 57.0), "1T": (160, 25600, 128, 512, 512, 71.49, 56.3, 57.0)}
A100_PEAK = 312e12


@pytest.mark.parametrize("name", list(TABLE_5))
def test_mfu_and_hfu_reproduce_korthikanti_table_5(name):
    heads, hidden, layers, gpus, batch, seconds, want_mfu, want_hfu = TABLE_5[name]
    model = Transformer(layers, hidden, heads, V, S)
    got_mfu = 100 * mfu(model, batch, seconds, gpus, A100_PEAK)
    got_hfu = 100 * hfu(model, batch, seconds, gpus, A100_PEAK, recompute="selective")
    # the times are printed to 0.01 s: 1.10 s is ±0.005 s = ±0.45 %, i.e. ±0.2 MFU points for the 22B
    slack = 100 * 0.005 / seconds * want_mfu / 100 + 0.05
    assert abs(got_mfu - want_mfu) <= slack + 0.01
    assert abs(got_hfu - want_hfu) <= slack + 0.01
    # the HFU/MFU ratio does not depend on the time: it checks the selective-recompute FLOP count alone
    assert got_hfu / got_mfu == pytest.approx(want_hfu / want_mfu, abs=0.0025)


def test_flop_formulas_closed_forms():
    m, B = GPT3_175B, 1536
    s, l, h = m.seq_len, m.layers, m.hidden
    assert model_flops(m, B) == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * h * l)), rel=1e-12)
    # Narayanan et al. 2021, Eq. 3 (full recomputation): 96 B s l h² (1 + s/6h + V/16lh)
    assert hardware_flops(m, B, "full") == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)),
                                                         rel=1e-12)
    assert hardware_flops(m, B, "selective") == pytest.approx(72 * B * s * l * h * h * (1 + s / (3 * h) + V / (12 * h * l)),
                                                              rel=1e-12)
    assert hardware_flops(m, B) == model_flops(m, B)


# Rajbhandari et al. 2020, Table 1, 7.5B model (K = 12): GB per device for P_os, P_os+g, P_os+g+p
# Source check (issue 18): confirmed from a source — the baseline 120 GB and, for N_d = 64, 31.4 GB and
# 16.6 GB, quoted by write-ups of the paper's Figure 1 / worked example (7.5 B, N_d = 64, K = 12); its
# P_os+g+p value is quoted as Figure 1's 1.9 GB, which the 1.88 here rounds to. NOT confirmed from a
# source: the 1.88 itself and the rows N_d = 4, 16, 256, 1024 (typed from memory); each equals the
# paper's own formulas (2 + 2 + K)Ψ, 4Ψ + KΨ/N_d, 2Ψ + (2 + K)Ψ/N_d, (4 + K)Ψ/N_d to the digits printed.
ZERO_TABLE_1 = {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
                256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)}


@pytest.mark.parametrize("dp", list(ZERO_TABLE_1))
def test_model_states_reproduce_zero_table_1(dp):
    for stage, printed in zip((1, 2, 3), ZERO_TABLE_1[dp]):
        got = model_state_bytes_formula(7.5e9, dp, stage)["total"] / 1e9
        digits = 3 - len(str(int(printed))) if printed >= 1 else 2   # 3 significant digits
        assert abs(got - printed) <= 0.5 * 10 ** -digits + 1e-9, (dp, stage, got, printed)


def test_bad_model_and_arguments():
    with pytest.raises(ValueError, match="divisible by heads"):
        Transformer(2, 30, 4, 64, 16)
    with pytest.raises(ValueError, match="positive integer"):
        Transformer(0, 32, 4, 64, 16)
    with pytest.raises(ValueError, match="recompute"):
        activation_bytes_per_layer(GPT3_175B, 1, recompute="some")
    with pytest.raises(ValueError, match="tp must divide"):
        activation_bytes_per_layer(GPT3_175B, 1, tp=7)

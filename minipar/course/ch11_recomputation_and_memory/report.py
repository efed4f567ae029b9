"""Chapter 11's runs and displays: each ``show_*`` prints (or draws) what one cell ran and holds it to the
chapter's claims (:mod:`.claims`), printing nothing more when they hold — so a cell reads ``r = run(...)``,
``show(r)``. The model of sections 1–4 and 6: the tiny GPT (3 blocks, h = 64, 4 heads, dropout 0.1) at
s = 64, batch 4, FP32."""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from minipar import comm
from minipar.activations import activation_bytes_formula
from minipar.launcher import launch
from minipar.loop import lm_loss
from minipar.memory import measure_step, saved_activation_bytes
from minipar.models import GPTConfig, TinyGPT
from minipar.observe.paced_compute import alternating_steps, paired_ratios, unsteady
from minipar.recompute import MODES, activation_bytes_per_block, apply_recompute, step_flops

from . import claims
from .figures import draw_length_sweep, draw_timelines, timelines
from .gpt3 import GPT3, show_gpt3_dial, show_gpt3_logits, show_segments, show_three_counts

__all__ = ["CFG", "S", "B", "H", "A", "LENGTHS", "one_step", "show_one_step", "activations_per_block",
           "show_activations_per_block", "length_sweep", "show_length_sweep", "fused_attention", "show_fused",
           "gradients_identical", "show_identical", "flops_by_mode", "show_flops", "full_extra_model",
           "timelines", "show_timelines", "ddp_per_mode", "show_ddp", "ddp_bytes_formula", "show_gpt3_dial", "show_gpt3_logits",
           "show_segments",
           "show_three_counts", "per_block_modes", "show_per_block_modes", "times_by_mode", "show_times"]

CFG = GPTConfig(n_layer=3, n_embd=64, n_head=4, block_size=64, dropout=0.1)
S, B, H, A = 64, 4, CFG.n_embd, CFG.n_head
LONG = GPTConfig(n_layer=3, n_embd=H, n_head=A, block_size=512, dropout=0.1)
LENGTHS = (64, 128, 256, 512)


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(CFG.vocab_size, (B, S), generator=g), torch.randint(CFG.vocab_size, (B, S), generator=g))


def psi() -> int:
    return sum(p.numel() for p in TinyGPT(CFG).parameters())


# ---- 1. where the memory goes -------------------------------------------------------------------------

def one_step(mode: str = "none"):
    """The second Adam step's accounting (the first creates the gradients and Adam's state)."""
    x, y = _batch()
    model = apply_recompute(TinyGPT(CFG), mode)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        model.loss(x, y).backward()
        opt.step()
    measure_step(step, model.parameters(), opt)
    opt.zero_grad(set_to_none=True)
    return measure_step(step, model.parameters(), opt)


def head_and_loss_bytes() -> int:
    """Bytes the final LayerNorm, the LM head and the loss keep for backward (their input included): the
    LayerNorm's input and output (2·h values a token) and the FP32 log-probabilities (V a token) are most of it."""
    model, (_, y) = TinyGPT(CFG), _batch()
    h = torch.randn(B, S, H, requires_grad=True)                 # what the last block hands on
    return saved_activation_bytes(lambda h: lm_loss(model.head(model.ln_f(h)), y), h,
                                  exclude=list(model.parameters()))[1]


def show_one_step(acc) -> None:
    n, head = psi(), head_and_loss_bytes()
    parts = (("parameters", acc.params), ("gradients", acc.grads), ("Adam m + v", acc.optimizer),
             ("activations", acc.activations))
    for name, nbytes in (*parts, ("their sum", sum(b for _, b in parts)), ("peak", acc.peak)):
        print(f"{name:12}{nbytes / 1024:8.0f} KiB")
    print(f"Ψ = {n:,} parameters; model states {acc.model_states / n:g} bytes each")
    print(f"activations {acc.activations:,} B: blocks and embedding {acc.activations - head:,} B, "
          f"head and loss {head:,} B (vocabulary V = {CFG.vocab_size})")
    each = 4 * B * S * H
    print(f"  of which ln_f's input, the head's input and the log-probabilities, {each:,} B each (h = V = {H}), "
          f"+ {head - 3 * each:,} B (mostly LayerNorm's statistics and the targets)")
    claims.check_4_4_8_bytes_per_parameter(acc, n)
    claims.check_head_and_loss(head, S * B, H, CFG.vocab_size)
    claims.check_peak_below_sum(acc)


# ---- 2. activations per block --------------------------------------------------------------------------

def activations_per_block() -> list:
    """[(dtype, mode, measured, formula with μ = β, the paper's 2-byte values and 1-byte masks)]."""
    rows = []
    for dtype, beta in ((torch.float32, 4), (torch.bfloat16, 2)):
        for mode in MODES:
            got = activation_bytes_per_block(CFG, mode, B, S, dtype)
            want = activation_bytes_formula(S, B, H, A, recompute=mode, value_bytes=beta, mask_bytes=beta)
            rows.append((str(dtype)[6:], mode, got, want, activation_bytes_formula(S, B, H, A, recompute=mode)))
    return rows


def show_activations_per_block(rows) -> None:
    print(f"{'dtype':9}{'mode':>10}{'measured (CPU)':>16}{'formula (μ = β)':>17}{'paper (β=2, μ=1)':>18}")
    for r in rows:
        print(f"{r[0]:9}{r[1]:>10}{r[2]:>16,}{r[3]:>17,.0f}{r[4]:>18,.0f}")
    claims.check_activations_per_block_formula_measurement(rows)


def length_sweep() -> dict:
    """{s: (measured bytes one block keeps, the formula's linear part, its s² part)} (FP32, μ = β, none)."""
    sweep = {}
    for s in LENGTHS:
        linear = activation_bytes_formula(s, B, H, A, recompute="selective", value_bytes=4, mask_bytes=4)
        quadratic = activation_bytes_formula(s, B, H, A, recompute="none", value_bytes=4, mask_bytes=4) - linear
        sweep[s] = (activation_bytes_per_block(LONG, "none", B, s, torch.float32), linear, quadratic)
    return sweep


def show_length_sweep(sweep) -> None:
    print(f"{'s':>5}{'measured':>13}{'formula':>13}{'linear part':>13}{'s² part':>13}{'s² share':>10}{'× per 2s':>10}")
    for s, (got, lin, quad) in sweep.items():
        growth = f"{got / sweep[s // 2][0]:.2f}" if s // 2 in sweep else ""
        print(f"{s:>5}{got:>13,}{lin + quad:>13,.0f}{lin:>13,.0f}{quad:>13,.0f}{quad / (lin + quad):>10.0%}{growth:>10}")
    s, h, a = GPT3["s"], GPT3["h"], GPT3["a"]
    crossing, ratio = 34 * h / (5 * a), 5 * a * s / (34 * h)
    print(f"GPT-3's shape (h/a = {h // a}), the paper's bytes: the s² part equals the linear part at s = {crossing:.0f}; "
          f"at s = {s} it is {ratio:.1f}× the linear part")
    fig, ax = plt.subplots(figsize=(9, 4))
    draw_length_sweep(ax, sweep)
    plt.show()
    claims.check_over_sequence_length(sweep)
    claims.check_gpt3_crossing(crossing, ratio)


def fused_attention() -> dict:
    """{s: (unfused bytes saved, fused bytes saved, their models, same output)} for one attention core
    (b = 4, a = 4, d = 16, no dropout, FP32): the model's unfused ``attention`` against PyTorch's
    ``scaled_dot_product_attention``; q, k, v themselves are not counted (the block keeps them either way)."""
    core = TinyGPT(LONG).blocks[0].attn.eval()           # eval: no dropout, so both compute the same thing
    d, out = H // A, {}
    for s in LENGTHS:
        q, k, v = (torch.randn(B, A, s, d, requires_grad=True) for _ in range(3))
        out_u, unfused = saved_activation_bytes(core.attention, q, k, v, exclude=[q, k, v])
        out_f, fused = saved_activation_bytes(F.scaled_dot_product_attention, q, k, v, is_causal=True, exclude=[q, k, v])
        lse = fused - out_f.numel() * out_f.element_size()                  # what the kernel saves besides O
        models = (4 * A * s * s * B + s * s, 4 * (s * B * H + A * s * B), 4 * A * s * B)  # P + bool mask; O + LSE; LSE
        out[s] = (unfused, fused, models, torch.allclose(out_u, out_f, atol=1e-5), type(out_f.grad_fn).__name__, lse)
    return out


def show_fused(fused, sweep) -> None:
    print(f"{'s':>5}{'unfused: P + mask':>19}{'fused: O + LSE':>16}{'LSE alone':>11}  same output")
    for s, (u, f, m, same, _, lse) in fused.items():
        print(f"{s:>5}{u:>19,}{f:>16,}{lse:>11,}  {str(same):>11}")
    match = all((u, f, lse) == m for u, f, m, _, _, lse in fused.values())
    print("bytes by formula: P + mask 4·b·a·s² + s², O + LSE 4·(b·s·h + b·a·s), LSE 4·b·a·s; "
          f"{'equal to the measured at every s' if match else 'NOT equal to the measured'}")
    print("the fused kernel's backward node at every s:", ", ".join(sorted({row[4] for row in fused.values()})))
    fig, ax = plt.subplots(figsize=(9, 4))
    draw_length_sweep(ax, sweep, fused)
    plt.show()
    claims.check_attention_without_matrix(fused)


# ---- 3. gradients ---------------------------------------------------------------------------------------

def _grads(mode):
    x, y = _batch()
    model = apply_recompute(TinyGPT(CFG), mode)
    torch.manual_seed(1)                    # the same dropout masks in every mode
    model.loss(x, y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def gradients_identical() -> dict:
    reference = _grads("none")
    return {mode: all(torch.equal(g, reference[n]) for n, g in _grads(mode).items()) for mode in ("selective", "full")}


def show_identical(identical) -> None:
    for mode, same in identical.items():
        print(f"{mode}: every gradient bit-identical to no recomputation: {same}")
    claims.check_how_built(identical)


# ---- 4. FLOPs -------------------------------------------------------------------------------------------

def _flop_models():
    L, V = CFG.n_layer, CFG.vocab_size
    block_forward = 24 * B * S * H * H + 4 * B * S * S * H       # QKV, projection, MLP (2·bs·12h²) + QKᵀ and P·V
    step_model = 3 * (L * block_forward + 2 * B * S * H * V)      # forward + backward (2×), LM head included
    return L, block_forward, step_model


def full_extra_model() -> float:
    """Full recomputation's extra FLOPs as a fraction of a step: one more forward of every block."""
    L, block_forward, step_model = _flop_models()
    return L * block_forward / step_model


def flops_by_mode() -> dict:
    x, y = _batch()
    return {mode: step_flops(apply_recompute(TinyGPT(CFG), mode), x, y) for mode in MODES}


def show_flops(flops) -> None:
    for mode in MODES:
        print(f"{mode:9}: {flops[mode] / 1e6:8.1f} MFLOP  (+{flops[mode] / flops['none'] - 1:.1%})")
    L, block_forward, step_model = _flop_models()
    claims.check_what_costs_flops(flops, CFG, B, S, H, L, block_forward, step_model)


# ---- 5. timeline; 6. under DDP --------------------------------------------------------------------------

def show_timelines(data) -> None:
    fig, ax = plt.subplots(figsize=(10, 4))
    draw_timelines(ax, data)
    plt.show()
    peaks = {mode: data[mode][1] for mode in MODES}
    print(f"§1's model ({CFG.n_layer} blocks), peak of the bytes forward + backward create, gradients included\n  (§1's peak adds the parameters and Adam's m and v, created before): "
          + ", ".join(f"{m} {p / 1024:.0f} KiB" for m, p in peaks.items()))
    claims.check_one_steps_memory_as_timeline(peaks)


def _rank_step(rank, world_size, mode):
    from minipar.data.ddp import DistributedDataParallel
    from minipar.loop import shard_batch
    model = apply_recompute(TinyGPT(CFG), mode)
    ddp = DistributedDataParallel(model)
    xs, ys = shard_batch(_batch(), rank, world_size)

    def step():
        logits = ddp(xs)                                   # forward through DDP: its backward all-reduces
        F.cross_entropy(logits.flatten(0, 1), ys.flatten()).backward()
    with comm.recording() as log:
        acc = measure_step(step, model.parameters())
    return acc.peak, log.bytes_sent, [p.grad.clone() for p in model.parameters()]


def ddp_per_mode(world_size: int = 2) -> dict:
    """{mode: [(peak, bytes sent, gradients) per rank]} for one DDP step of the section-1 model."""
    return {mode: launch(_rank_step, world_size, mode, quiet=True) for mode in MODES}


def ddp_bytes_formula(world_size: int = 2) -> int:
    """A ring all-reduce of every FP32 gradient: 2(N−1)/N · 4Ψ bytes sent per rank."""
    return int(comm.predicted_bytes_sent("all_reduce", 4 * psi(), world_size))


def show_ddp(per_rank) -> None:
    for mode in MODES:
        print(f"{mode:9}: peak per rank {[f'{r[0] / 1024:.0f} KiB' for r in per_rank[mode]]}, "
              f"sent per rank {per_rank[mode][0][1]:,} B")
    claims.check_same_communication(per_rank)


# ---- 7. a memory budget, one mode per block; Deeper: time --------------------------------------------------

def per_block_modes(mix) -> dict:
    """{label: (peak bytes, step FLOPs)} of the section-1 model with every block 'none', with one mode per block
    (``mix``, e.g. ["full", "selective", "none"]), and with every block 'full'."""
    x, y = _batch()
    return {label: (one_step(modes).peak, step_flops(apply_recompute(TinyGPT(CFG), modes), x, y))
            for label, modes in (("none", "none"), (" / ".join(mix), list(mix)), ("full", "full"))}


def show_per_block_modes(runs) -> None:
    for label, (peak, flops) in runs.items():
        print(f"{label:26}: peak {peak / 1024:5.0f} KiB, {flops / 1e6:6.1f} MFLOP (+{flops / runs['none'][1] - 1:.1%})")
    claims.check_per_block_modes(runs)


def _train_step(mode):
    x, y = _batch()
    model = apply_recompute(TinyGPT(CFG), mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(x, y).backward()
        opt.step()
    return step


def times_by_mode() -> dict:
    """{mode: [seconds of each round]}: one step of each mode per round, alternating (a busy spell of a shared
    machine falls on all three)."""
    return alternating_steps({mode: _train_step(mode) for mode in MODES}, rounds=12, warmup=2)


def show_times(seconds, flops, loaded=None) -> None:
    """Each mode's fastest step, its FLOPs against none's, and its time against none's: the median of the
    per-round ratios with its verdict (``paced_compute.paired_ratios``; appendix A explains the method), or, when
    other load disturbed the steps (``loaded``; default: judged on the steps, ``paced_compute.unsteady``), "not
    compared" in its place."""
    loaded = unsteady(seconds) if loaded is None else loaded
    print("step time by mode (indicative on a shared CPU)\n"
          "mode       fastest step  × none's FLOPs  time ÷ none's (median of paired rounds)")
    for mode in MODES:
        t = seconds[mode]
        line = f"{mode:9}  {min(t) * 1e3:9.1f} ms  {flops[mode] / flops['none']:14.2f}  "
        if mode == "none":
            line += "1"
        else:
            _, median, _, verdict = paired_ratios(t, seconds["none"], loaded)
            line += verdict if loaded else f"≈{median:.2f}, {verdict}"
        print(line)
    claims.check_step_times(seconds)

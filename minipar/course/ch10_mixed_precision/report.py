"""Chapter 10's displays: each runs or prints what one cell shows, draws its picture, and holds it to the
chapter's claims (:mod:`.claims`), printing nothing more when they hold — so a cell reads ``show(...)``."""
from __future__ import annotations

import math
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch

from minipar import comm, launch
from minipar.check import gpt_recipe
from minipar.memory import measured_model_state_bytes, saved_activation_bytes
from minipar.precision.formats import BF16, FORMATS, FP16, FP32, decompose, round_to, spacing, vanishing_ratio
from minipar.precision.loss_scaler import DynamicLossScaler
from minipar.precision.mixed import MixedPrecision, ddp_parallel_train, fp32_loss, train_mixed, underflow_fraction

from . import claims
from .figures import draw_bit_layouts, draw_gradient_histogram, draw_ranges, draw_spacing, draw_vanishing_ratios
from .sharded_overflow import show_sharded_overflow
from .sixteen_bit_compute import show_accumulation, show_autocast
from .training import show_training, train_four_ways

__all__ = ["show_model", "show_bit_layouts", "show_ranges", "show_fp16_edges", "show_underflow", "overflowing_step",
           "show_against_gradscaler", "show_clip_after_unscale", "show_sharded_overflow",
           "show_scale_history", "show_vanishing_sweep",
           "show_sgd_updates_lost", "show_adam_gain", "train_four_ways", "show_training", "show_bf16_underflow",
           "show_accumulation", "measure_model_state", "show_what_halves", "show_autocast"]


def show_model(recipe) -> None:
    """The tiny GPT this chapter trains: its shape, its parameter count Ψ and its LayerNorm gains (§6 counts them)."""
    model = recipe.model()
    cfg = model.cfg
    psi = sum(p.numel() for p in model.parameters())
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    gains = sum(m.weight.numel() for m in norms)
    print(f"tiny GPT: {cfg.n_layer} layers, hidden {cfg.n_embd}, {cfg.n_head} heads, vocabulary {cfg.vocab_size}; "
          f"Ψ = {psi:,} parameters; {len(norms)} LayerNorms × {cfg.n_embd} = {gains} gain values")


def show_bit_layouts(values=(1.0, -2.5, 0.1, 65504.0)) -> None:
    """Each value rounded into each format, its bits, and the value recomputed from the fields."""
    exact = []
    for x in values:
        for f in FORMATS.values():
            d = decompose(x, f)
            exact.append(d.value == round_to(x, f))        # the formula gives exactly what torch stores
            print(f"{x:>8} {f.name}: {d.bit_string:<36} {d.kind:8} -> {d.value!r}")
    fig, ax = plt.subplots(figsize=(10, 3))
    draw_bit_layouts(ax, -2.5)
    plt.show()
    claims.check_three_bit_layouts(exact)


def show_ranges() -> None:
    """Range and precision of each format from its bit counts, beside ``torch.finfo``; two pictures."""
    print(f"{'':5}{'max':>12}{'min normal':>12}{'min subnormal':>15}{'eps':>11}{'digits':>8}{'decades':>9}")
    decades = {f.name: math.log10(f.max / f.smallest_subnormal) for f in FORMATS.values()}
    for f in FORMATS.values():
        print(f"{f.name:5}{f.max:12.4g}{f.smallest_normal:12.3g}{f.smallest_subnormal:15.3g}{f.eps:11.3g}"
              f"{f.decimal_digits:8.1f}{decades[f.name]:9.1f}")
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    draw_ranges(a)
    draw_spacing(b)
    plt.tight_layout()
    plt.show()
    claims.check_range_precision_computed_from_layout({f.name: torch.finfo(f.dtype) for f in FORMATS.values()})
    claims.check_table_claims_checked(decades)


def show_fp16_edges() -> None:
    """FP16's edges, one value at a time."""
    edges = {"65504 -> ": round_to(65504, FP16), "65520 -> ": round_to(65520, FP16),
             "2^-25 -> ": round_to(2.0 ** -25, FP16), "3e-8 -> ": round_to(3e-8, FP16),
             "2049 -> ": round_to(2049, FP16), "1 + 2^-11 -> ": round_to(1 + 2.0 ** -11, FP16)}
    for k, v in edges.items():
        print(k, v)
    claims.check_flush_only_or_below_2_25(edges)


def show_underflow(make, x, y, gpt=None) -> SimpleNamespace:
    """First (``gpt``, a recipe) the share of the tiny GPT's FP16 gradients flushed to 0, a model not built to
    underflow; then the almost fitted MLP's with no loss scale and with 2^16."""
    flushed = {}
    if gpt is not None:
        name = "tiny GPT, FP16, no loss scaling"
        flushed[name] = _gpt_underflow(gpt)
        print(f"{name}: {flushed[name]:.1%} of its gradient values that FP32 keeps are exactly 0")
    fp32_model = make()
    fp32_loss(fp32_model, x, y).backward()
    g32 = [p.grad for p in fp32_model.parameters()]
    for name, scaler in (("FP16, no loss scaling", None), ("FP16, loss scale 2^16", DynamicLossScaler())):
        mp = MixedPrecision(make(), lambda ps: torch.optim.SGD(ps, lr=0.0), torch.float16, scaler)
        mp.backward(fp32_loss(mp.model, x, y))
        flushed[name] = underflow_fraction([p.grad for p in mp.model.parameters()], g32)
        print(f"built MLP, {name}: {flushed[name]:.1%} of the gradient values that FP32 keeps are exactly 0")
    fig, ax = plt.subplots(figsize=(9, 4))
    draw_gradient_histogram(ax)
    plt.show()
    claims.check_overflow_underflow_real_step(flushed)
    return SimpleNamespace(make=make, x=x, y=y, g32=g32, flushed=flushed)


def _gpt_underflow(recipe) -> float:
    """The share of the tiny GPT's non-zero FP32 gradient values (first batch) that FP16 flushes to 0."""
    x0, y0 = recipe.batches[0]
    fp32_model = recipe.model()
    fp32_loss(fp32_model, x0, y0).backward()
    mp = MixedPrecision(recipe.model(), recipe.optimizer, torch.float16, None)
    mp.backward(fp32_loss(mp.model, x0, y0))
    return underflow_fraction([p.grad for p in mp.model.parameters()], [p.grad for p in fp32_model.parameters()])


def overflowing_step(recipe, init_scale: float = 2.0 ** 30) -> SimpleNamespace:
    """One FP16 backward of the tiny GPT at ``init_scale``: how many gradients overflow, and what the scaler does."""
    mp = MixedPrecision(recipe.model(), recipe.optimizer, torch.float16, DynamicLossScaler(init_scale=init_scale))
    x0, y0 = recipe.batches[0]
    mp.backward(fp32_loss(mp.model, x0, y0))
    g16 = [p.grad for p in mp.model.parameters()]
    n_inf = sum(int((~torch.isfinite(g)).sum()) for g in g16)
    n_all = sum(g.numel() for g in g16)
    print(f"scale 2^{math.log2(init_scale):.0f}: {n_inf} of {n_all} FP16 gradient values are inf/NaN")
    before = mp.master_params()
    stepped = mp.step()
    print("step taken:", stepped)
    untouched = all(torch.equal(before[n], v) for n, v in mp.master_params().items())   # weights untouched
    claims.check_overflow_skips_step_and_halves_scale(n_inf, stepped, mp, untouched)
    return SimpleNamespace(new_scale=int(mp.scaler.loss_scale), backoff_factor=mp.scaler.backoff_factor)


def show_against_gradscaler(growth_interval: int = 3) -> None:
    """Ours and ``torch.amp.GradScaler`` on one sequence of clean and overflowing steps, side by side."""
    pattern = [None, None, None, float("inf"), None, None, None, None, float("nan"), None, None, None]
    p_ours, p_torch = (torch.nn.Parameter(torch.ones(4)) for _ in range(2))
    opt_ours, opt_torch = torch.optim.SGD([p_ours], lr=0.1), torch.optim.SGD([p_torch], lr=0.1)
    ours = DynamicLossScaler(growth_interval=growth_interval)
    theirs = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    print(f"{'step':>4} {'grad':>6} {'ours: scale after, stepped':>27} {'GradScaler: scale after':>23}")
    agree = []
    for i, bad in enumerate(pattern):
        for p, opt, s in ((p_ours, opt_ours, ours), (p_torch, opt_torch, theirs)):
            opt.zero_grad()
            s.scale((p * 3).sum()).backward()
            if bad is not None:
                p.grad[0] = bad
        stepped = ours.step(opt_ours)
        theirs.step(opt_torch)
        theirs.update()
        print(f"{i:>4} {'clean' if bad is None else str(bad):>6} {ours.loss_scale:>19.0f} {str(stepped):>7} "
              f"{theirs.get_scale():>23.0f}")
        agree.append(ours.loss_scale == theirs.get_scale() and stepped == (bad is None))
    claims.check_dynamic_loss_scaling_step_by(agree, p_ours, p_torch)


def _clipped_norm(unscale_first: bool, max_norm: float, scale: float) -> tuple:
    """One GradScaler step with clipping: (the norm ``clip_grad_norm_`` saw, the true gradient norm after)."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale((p * torch.tensor([3.0, 4.0, 0.0, 0.0])).sum()).backward()     # true gradient norm 5
    if unscale_first:
        scaler.unscale_(opt)
    seen = float(torch.nn.utils.clip_grad_norm_([p], max_norm))
    if not unscale_first:
        scaler.unscale_(opt)
    return seen, float(p.grad.norm())


def show_clip_after_unscale(max_norm: float = 1.0, scale: float = 2.0 ** 16) -> None:
    """Clipping before and after ``scaler.unscale_``: the norm the clip sees, and the gradient norm it leaves."""
    rows = {order: _clipped_norm(order == "unscale_, then clip", max_norm, scale)
            for order in ("clip, then unscale_", "unscale_, then clip")}
    for order, (seen, after) in rows.items():
        print(f"{order:20}: clip_grad_norm_ sees norm {seen:g}, the optimizer gets norm {after:.3g} "
              f"(max_norm {max_norm})")
    claims.check_clip_after_unscale(rows, max_norm, scale)


def show_scale_history(recipe, init_scale: float = 2.0 ** 20) -> None:
    """The tiny GPT trained in FP16 from a scale that is too high: the scaler's decision at each step."""
    _, mp = train_mixed(recipe, torch.float16, DynamicLossScaler(init_scale=init_scale))
    for step, (scale, overflow, stepped) in enumerate(mp.scaler.history):
        print(f"step {step}: scale 2^{math.log2(scale):.0f}  overflow={overflow}  stepped={stepped}")
    claims.check_skipped_first_then_trains(mp)


def show_vanishing_sweep(ws=(1.0, 1.25, 1.5, 1.75, 1.9, 1.999)) -> dict:
    """{w: (FP16 measured, FP16 model 2w/gap, BF16 measured, BF16 model)}, printed and drawn."""
    print(f"{'w':>6} {'w in FP16':>13} {'FP16: measured':>15} {'model 2w/gap':>13} {'w in BF16':>10} "
          f"{'BF16: measured':>15} {'model':>7}")
    sweep = {}
    for w in ws:
        w16, wb = round_to(w, FP16), round_to(w, BF16)
        sweep[w] = (vanishing_ratio(w, FP16), 2 * w16 / spacing(w16, FP16),
                    vanishing_ratio(w, BF16), 2 * wb / spacing(wb, BF16))
        print(f"{w:>6} {w16!r:>13} {sweep[w][0]:>15} {sweep[w][1]:>13.0f} {wb!r:>10} {sweep[w][2]:>15} "
              f"{sweep[w][3]:>7.0f}")
    w = torch.tensor(1.9, dtype=torch.float16)
    kept = w + w / 3000                                      # all in torch.float16 arithmetic
    print(f"FP16: 1.9 + 1.9/3000 = {float(kept)!r}, not {float(w)!r}: the update survives although w/u = 3000 > 2048")
    fig, ax = plt.subplots(figsize=(9, 3.5))
    draw_vanishing_ratios(ax)
    plt.show()
    claims.check_model_us_own_rounding(kept, w, sweep)
    return sweep


def show_sgd_updates_lost(recipe, lr: float = 0.01) -> None:
    """One SGD step of the tiny GPT applied to its weights held in each format: the share of updates lost."""
    model = recipe.model()
    fp32_loss(model, *recipe.batches[0]).backward()
    lost = {}
    for f in FORMATS.values():
        gone = total = 0
        for p in model.parameters():
            upd = -lr * p.grad
            w_f = p.detach().to(f.dtype)
            gone += int(((w_f + upd.to(f.dtype)) == w_f)[upd != 0].sum())
            total += int((upd != 0).sum())
        lost[f.name] = gone / total
        print(f"weights in {f.name}: {lost[f.name]:.1%} of the updates vanish")
    claims.check_master_weights_why_small_updates(lost)


def show_adam_gain(lr: float = 3e-4, n: int = 256) -> None:
    """Adam's first step on a LayerNorm gain at 1.0, applied to the gain held in each format."""
    gain = torch.nn.Parameter(torch.ones(n))                 # a LayerNorm gain at its initial value
    gain.grad = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    opt = torch.optim.Adam([gain], lr=lr)
    before = gain.detach().clone()
    opt.step()
    update = gain.detach() - before                          # |update| = lr at Adam's first step
    print(f"|w| / lr = {1.0 / lr:.0f};  Adam's update: |u| from {update.abs().min():.2e} to {update.abs().max():.2e}")
    adam_lost = {}
    for f in FORMATS.values():
        w_f = before.to(f.dtype)
        adam_lost[f.name] = float(((w_f + update.to(f.dtype)) == w_f).float().mean())
        print(f"LayerNorm gain in {f.name}: {adam_lost[f.name]:.0%} of the Adam updates vanish")
    vanished16 = (before.half() + update.half()) == before.half()
    print(f"in FP16: {float(vanished16[update > 0].float().mean()):.0%} of the updates up vanish, "
          f"{float(vanished16[update < 0].float().mean()):.0%} of those down")
    claims.check_lr_g_g_eps(update, adam_lost, bool(vanished16[update > 0].all()))
    claims.check_updates_down_survive(vanished16, update)


def show_bf16_underflow(case) -> None:
    """The almost fitted MLP of §3 in BF16 with no loss scale: the share of its gradients flushed to 0."""
    mp = MixedPrecision(case.make(), lambda ps: torch.optim.SGD(ps, lr=0.0), torch.bfloat16)
    mp.backward(fp32_loss(mp.model, case.x, case.y))
    bf16_flushed = underflow_fraction([p.grad for p in mp.model.parameters()], case.g32)
    print(f"BF16, no loss scaling: {bf16_flushed:.2%} of the gradient values flushed to 0 "
          f"(FP16 on the same built MLP: {case.flushed['FP16, no loss scaling']:.0%})")
    print(f"relative rounding error: FP16 {FP16.eps / 2:.1e}, BF16 {BF16.eps / 2:.1e}, FP32 {FP32.eps / 2:.1e}")
    zero_at = {f.name: f.smallest_subnormal / 2 for f in FORMATS.values()}   # at or below half a step: a tie to 0
    print("rounds to 0 at or below: " + ", ".join(f"{name} {v:.2g}" for name, v in zero_at.items()))
    claims.check_bf16_needs_no_scaler(mp, bf16_flushed, zero_at)


def measure_model_state(recipe) -> float:
    """Model-state bytes per parameter of FP32 and mixed-precision Adam, from live tensors; returns the latter."""
    x0, y0 = recipe.batches[0]
    psi = sum(p.numel() for p in recipe.model().parameters())
    fp32_model = recipe.model()
    fp32_opt = torch.optim.Adam(fp32_model.parameters(), lr=1e-3)
    fp32_loss(fp32_model, x0, y0).backward()
    fp32_opt.step()                                          # creates Adam's m and v
    fp32_loss(fp32_model, x0, y0).backward()                 # the gradients alive again
    state = {"FP32 Adam": measured_model_state_bytes(fp32_model.parameters(), fp32_opt)}
    mp = MixedPrecision(recipe.model(), lambda ps: torch.optim.Adam(ps, lr=1e-3), torch.float16)
    mp.backward(fp32_loss(mp.model, x0, y0))
    mp.step()
    mp.backward(fp32_loss(mp.model, x0, y0))
    compute, master = measured_model_state_bytes(mp.compute), measured_model_state_bytes(mp.master, mp.optimizer)
    state["mixed-precision Adam"] = {"16-bit params": compute["params"], "16-bit grads": compute["grads"],
                                     "FP32 masters": master["params"], "Adam m, v": master["optimizer"]}
    per_param = {name: sum(parts.values()) / psi for name, parts in state.items()}
    for name, parts in state.items():
        print(f"{name:21}: " + ", ".join(f"{k} {v / psi:g}" for k, v in parts.items())
              + f"  = {per_param[name]:g} B/param")
    mp.copy_grads_up()                                       # step's first move: FP32 grads replace 16-bit ones
    during_step = sum(sum(measured_model_state_bytes(*ps).values())
                      for ps in ((mp.compute,), (mp.master, mp.optimizer))) / psi
    print(f"{'  ... during its step':21}: 16-bit grads 0, FP32 master grads 4  = {during_step:g} B/param")
    claims.check_what_16_bits_halve_what(per_param, master, during_step)
    return per_param["mixed-precision Adam"]


def _sent_per_rank(rank, world_size, dtype):                 # one DDP step, gradients all-reduced in dtype
    log = comm.CommLog()
    ddp_parallel_train(rank, world_size, gpt_recipe(steps=1), dtype, step_log=log)
    return log.bytes_sent


def show_what_halves(recipe) -> None:
    """Activation bytes saved for backward (FP32 vs BF16) and bytes each of 2 DDP ranks sends (FP32 vs FP16)."""
    x0, y0 = recipe.batches[0]
    psi = sum(p.numel() for p in recipe.model().parameters())
    acts = {}
    for dt in (torch.float32, torch.bfloat16):
        m = recipe.model().to(dt)
        _, acts[dt] = saved_activation_bytes(fp32_loss, m, x0, y0, exclude=list(m.parameters()))
    wire = {dt: launch(_sent_per_rank, 2, dt, quiet=True)[0] for dt in (torch.float32, torch.float16)}
    wire_model = {dt: comm.predicted_bytes_sent("all_reduce", dt.itemsize * psi, 2) for dt in wire}
    act_ratio, wire_ratio = acts[torch.float32] / acts[torch.bfloat16], wire[torch.float32] / wire[torch.float16]
    print(f"activations saved for backward: FP32 {acts[torch.float32]:,} B, BF16 {acts[torch.bfloat16]:,} B  "
          f"(÷{act_ratio:.2f})")
    print(f"DDP, sent per rank:             FP32 {wire[torch.float32]:,} B, FP16 {wire[torch.float16]:,} B  "
          f"(÷{wire_ratio:.2f}); model 2·βΨ(N−1)/N: {wire_model[torch.float32]:,.0f} and "
          f"{wire_model[torch.float16]:,.0f} B")
    claims.check_16_bits_halve_wire_and_activations(act_ratio, wire_ratio, wire, wire_model)

"""Chapter 00's displays: each prints (or draws) what one cell computed and holds it to the chapter's claims
(:mod:`.claims`), printing nothing more when they hold — so a cell ends with one ``report.show_...(...)``."""
from __future__ import annotations

import inspect
import math
import os

import matplotlib.pyplot as plt
import torch

from . import claims
from . import tour as ch00
from .figures import draw_collective, plot_ring_time, plot_traffic
from .latency import (SMALL_BYTES, beta_text, fit_ring, fitted_ranks, machine_cores, ring_model_seconds,
                      sweep_seconds)

__all__ = ["show_training_state", "show_adam_state", "show_compute", "show_whoami", "show_backends",
           "show_collective", "show_ring_steps", "show_rings", "show_busiest", "show_traffic", "show_ring_time",
           "show_launch_vs_mp", "show_torchrun"]

FOUR_ROWS = ("broadcast", "all_reduce", "reduce_scatter", "ring all_reduce")


def show_training_state(state_bytes: dict, device_bytes: float = 80e9) -> None:
    """{model: bytes of its training state} as GB and the number of ``device_bytes`` devices it needs."""
    print(f"{'':28} {'GB':>8} {'80 GB devices':>14}")
    for what, b in state_bytes.items():
        print(f"{what:28} {b / 1e9:>8,.0f} {math.ceil(b / device_bytes):>14}")
    claims.check_why_distributed_training_memory(state_bytes, device_bytes)


def show_adam_state(measured: dict, n_params: int, step_counters: list) -> None:
    print(f"{n_params:,} parameters")
    for what, b in measured.items():
        print(f"  {what:<20} {b:>9,} B = {b / n_params:g} B/param")
    total = sum(measured.values())
    print(f"  total                {total:>9,} B = {total / n_params:g} B/param; ZeRO's 2 + 2 + 12 = 16")
    print(f"  not in the 16: {len(step_counters)} step counters of {step_counters[0].element_size()} B, one per tensor")
    claims.check_adam_state_bytes_measured(measured, n_params)


def show_compute(flops: float, at_peak: float, achieved: float, with_recompute: float, one_gpu: float) -> None:
    """Days of training: 1024 A100s at peak, at 140 TFLOP/s, with recomputation; one A100 (also in days)."""
    print(f"6·N·D = {flops:.2e} FLOPs")
    print(f"1024 A100s at peak: {at_peak:.1f} days; at 140 TFLOP/s: {achieved:.1f} days; "
          f"with recomputation (8·N·D): {with_recompute:.1f} days")
    print(f"one A100 at 140 TFLOP/s: {one_gpu / 365:.0f} years")
    claims.check_oneflow_articles_month_holds(flops, at_peak, achieved, with_recompute, one_gpu / 365)


def show_whoami(info: list) -> None:
    for i in info:
        print(i)
    claims.check_no_env_rendezvous(info)


def show_backends(defaults: dict) -> None:
    import torch.distributed as dist
    print("default backend per device type:", {k: defaults[k] for k in ("cpu", "cuda")},
          f"(and {len(defaults) - 2} for other accelerators)")
    print("available in this torch build: gloo", dist.is_gloo_available(), "| nccl", dist.is_nccl_available(),
          "| mpi", dist.is_mpi_available())
    claims.check_backends_gloo_nccl_mpi(defaults)


def show_collective(name: str, outcomes: dict) -> None:
    """The code every rank ran; who held what before and after (drawn); the result held to one process's."""
    print(inspect.getsource(ch00.COLLECTIVES[name].run))
    got = [o["after"] for o in outcomes[name]]
    diff = ch00.compare_outputs(got, ch00.expected_outputs(name, 4, 8, "small"))
    draw_collective(name, outcomes[name])
    plt.show()
    claims.check_whole_numbers_sums_exact_any_order(diff, name)   # whole numbers: sums are exact in any order


def show_ring_steps(steps: list) -> None:
    """Every message of a ring all-reduce, step by step; each held to the rule worked out on one process."""
    n = len(steps)
    for k in range(2 * (n - 1)):
        phase, s = ("reduce-scatter", k + 1) if k < n - 1 else ("all-gather    ", k - n + 2)
        print(f"{phase} step {s}  " + "   ".join(f"{r}->{(r + 1) % n}: {[int(v) for v in steps[r][k]]}"
                                                 for r in range(n)))
    claims.check_every_message_worked_out_one_process(steps, n)


def show_rings(ring_outcome: dict, outcome: dict, log: list, payload_bytes: int) -> None:
    """The rings' results against torch.distributed's, and one rank's log of a ring all-reduce."""
    same = all(torch.equal(ring_outcome[f"ring {op}"][r]["after"], outcome[op][r]["after"])
               for op in ("reduce_scatter", "all_gather", "all_reduce") for r in range(4))
    print("the three rings hold exactly what torch.distributed's collectives held:", same)
    print(f"rank 0's log, ring all-reduce of {payload_bytes} B on 4 ranks (op, bytes sent, bytes received):")
    print(log)
    claims.check_ring_sends_2_n_minus_1_messages(same, [m for m in log if m[0] == "send"], 4, payload_bytes)


def show_busiest(rows: list, every_row: bool = False) -> None:
    """The 1 MiB table: the busiest rank's bytes under the formula and on the wire (four rows, or all)."""
    shown = rows if every_row else [r for r in rows if r["name"] in FOUR_ROWS]
    print(ch00.format_busiest(shown))
    claims.check_collectives_live_4_ranks(rows)
    claims.check_gloo_differs_on_the_wire({r["name"]: r for r in rows})


def show_traffic(sweep: dict, payload_bytes: int) -> dict:
    """Bytes the busiest rank sends, ring and root, per N (table and plot); returns {N: (ring, root)}."""
    s = payload_bytes
    busiest = {n: (max(t["ring"]["sent"]), max(t["root"]["sent"])) for n, t in sweep.items()}
    print(f"{'N':>2}  {'ring: busiest rank':>20}  {'root: busiest rank':>20}  {'total, ring = root':>20}")
    for n, t in sweep.items():
        ring, root = busiest[n]
        print(f"{n:>2}  {ring / s:>18.3f} S  {root / s:>18.3f} S  {sum(t['ring']['sent']) / s:>18.3f} S")
    plot_traffic(sweep, s)
    plt.show()
    claims.check_ring_bounded_root_linear(s, busiest, sweep)
    return busiest


def show_ring_time(sweep: dict, payload_bytes: int) -> None:
    """The ring's time per N at two sizes, measured and from the α-β model fitted to the N that fit on this
    machine's cores; which term dominates at S."""
    cores = machine_cores()
    fitted = fitted_ranks(sweep, cores)
    alpha, beta = fit_ring(sweep_seconds({n: sweep[n] for n in fitted}, payload_bytes))
    big = f"{payload_bytes // 1024} KiB"
    print(f"{'':>2}  {'':>5}  {'4 KiB (ms)':^17}  {big + ' (ms)':^17}")
    print(f"{'N':>2}  {'steps':>5}  {'measured':>8} {'model':>8}  {'measured':>8} {'model':>8}")
    for n, t in sweep.items():
        note = "fitted" if n in fitted else "waits for a core: read the model"
        print(f"{n:>2}  {2 * (n - 1):>5}  {t['small_ring_s'] * 1e3:>8.2f} "
              f"{ring_model_seconds(n, SMALL_BYTES, alpha, beta) * 1e3:>8.2f}  "
              f"{t['ring_s'] * 1e3:>8.2f} {ring_model_seconds(n, payload_bytes, alpha, beta) * 1e3:>8.2f}  {note}")
    print(f"this machine has {cores} cores: α and β are fitted to N ≤ {max(fitted)} only, "
          f"α = {alpha * 1e3:.3f} ms per ring step, β = {beta_text(beta)}")
    n = max(sweep)
    steps, data = 2 * (n - 1) * alpha, 2 * (n - 1) / n * payload_bytes / beta
    verdict = ("with β = ∞ the model prices only the steps" if math.isinf(beta)
               else f"the {'steps' if steps > data else 'bytes'} cost more")
    print(f"model at N = {n}, S = {big}: steps 2(N-1)·α = {steps * 1e3:.2f} ms, bytes 2(N-1)/N·S/β = "
          f"{data * 1e3:.2f} ms: {verdict}")
    plot_ring_time(sweep, payload_bytes, cores)
    plt.show()
    claims.check_ring_time_fitted_within_cores(fitted, cores, alpha, beta)
    claims.check_steps_cost_more_than_bytes(alpha, beta, SMALL_BYTES)


def show_launch_vs_mp(by_hand: list, with_launch: list) -> None:
    from torch.distributed.constants import default_pg_timeout
    print("torch.multiprocessing:", by_hand, "  minipar.launch:", with_launch)
    print("a collective waits, by default, up to", default_pg_timeout, "(h:mm:ss) before it fails")
    claims.check_appendix_minipar_launch_torch_multiprocessing(by_hand, with_launch)


def show_torchrun(command: str, workers: list, launched: list, env: list) -> None:
    """What each torchrun worker found in its environment and returned, beside minipar.launch's results."""
    print(f"$ {command}")
    print("  ".join(env))
    for w in workers:
        print("  ".join(f"{str(w['env'][k]):>{len(k)}}" for k in env))
    print("\nall_reduce_rank under torchrun:      ", [w["result"] for w in workers])
    print("all_reduce_rank under minipar.launch:", launched)
    claims.check_appendix_b_torchrun_for_real(workers, launched)

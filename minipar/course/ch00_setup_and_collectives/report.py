"""Chapter 00's displays: each prints (or draws) what one cell computed and holds it to the chapter's claims
(:mod:`.claims`), printing nothing more when they hold — so a cell ends with one ``report.show_...(...)``."""
from __future__ import annotations

import inspect
import math
import os

import matplotlib.pyplot as plt
import torch

from minipar.machine.cluster import IB_HDR, IB_NDR, NVLINK3, NVLINK4, PCIE3

from . import claims
from . import tour as ch00
from .figures import draw_collective, plot_ring_time, plot_traffic
from .torchrun_runner import run_torchrun_job   # section 3 starts it from here
from .latency import (FIT_RANKS, MIB, NCCL_RING_LATENCY, PUBLISHED_LINKS, nccl_link_type, SMALL_BYTES, crossover_bytes, fit_ring, fitted_ranks, machine_cores,
                      published_ring_rows, ring_model_seconds)

__all__ = ["run_torchrun_job", "show_training_state", "show_gpt3_days", "show_adam_state", "show_whoami", "show_backends",
           "show_collective", "show_ring_steps", "show_rings", "show_busiest", "show_traffic", "show_ring_time",
           "show_published_links", "show_later_links", "show_launch_vs_mp", "show_torchrun"]


def show_training_state(state: dict, device_bytes: float = 80e9) -> None:
    """{what: bytes of training state}: GB and the devices of ``device_bytes`` it needs."""
    print(f"{'':30} {'GB':>6}  {f'{device_bytes / 1e9:.0f} GB devices':>13}")
    for what, b in state.items():
        print(f"{what:30} {b / 1e9:>6,.0f}  {math.ceil(b / device_bytes):>13}")
    claims.check_why_distributed_training_memory(state, device_bytes)


def show_gpt3_days(flops: float, days: dict) -> None:
    """6·N·D and the days it takes: {label: days}, with the keys the cell computes."""
    print(f"6·N·D = {flops:.2e} FLOPs")
    rows = [("1024 A100s at peak, 312 TFLOP/s (6·N·D)", f"{days['at peak']:.1f} days"),
            ("1024 A100s at 140 TFLOP/s, with recomputation (8·N·D)", f"{days['with recomputation']:.1f} days"),
            ("1024 A100s at 140 TFLOP/s, if all were useful (6·N·D)", f"{days['achieved']:.1f} days"),
            ("one A100 at 140 TFLOP/s, if all were useful (6·N·D)", f"{days['one GPU'] / 365:.0f} years")]
    for what, value in rows:
        print(f"{what:<54} {value:>10}")
    claims.check_gpt3_month_holds(flops, days["at peak"], days["achieved"], days["with recomputation"],
                                  days["one GPU"] / 365)


def show_adam_state(measured: dict, n_params: int, step_counters: list) -> None:
    print(f"{n_params:,} parameters")
    for what, b in measured.items():
        print(f"  {what:<20} {b:>9,} B = {b / n_params:g} B/param")
    total = sum(measured.values())
    print(f"  total                {total:>9,} B = {total / n_params:g} B/param; ZeRO's 2 + 2 + 12 = 16")
    counters = sum(c.numel() * c.element_size() for c in step_counters)
    print(f"  not in the 16: Adam's step counters, {step_counters[0].element_size()} B each, one per parameter tensor"
          f" (TinyGPT has {len(step_counters)} tensors)")
    print(f"  {'total with counters':<20} {total + counters:>9,} B = {(total + counters) / n_params:.3f} B/param")
    claims.check_adam_state_bytes_measured(measured, n_params)


def show_whoami(info: list) -> None:
    for i in info:
        print(i)
    claims.check_no_env_rendezvous(info)


def show_backends(defaults: dict) -> None:
    import torch.distributed as dist
    others = ", ".join(f"{device}: {backend}" for device, backend in defaults.items() if device not in ("cpu", "cuda")
                       and backend != "fake")              # "fake": PyTorch's test backend, not a device's
    print("default backend per device type:", {k: defaults[k] for k in ("cpu", "cuda")},
          f"(other devices: {others})" if others else "")
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
    print(f"{name} on 4 ranks equals the same operation on one process: {'yes' if diff == 0 else 'NO'}")
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
    """The 1 MiB table: the busiest rank's bytes under the formula and on the wire (the ring's row, or all)."""
    ring = next(r for r in rows if r["name"] == "ring all_reduce")
    if every_row:
        print(ch00.format_busiest(rows))
    else:                                                  # section 7: the ring's one row, in plain words
        from minipar.course.tour import _fmt_bytes
        seen = _fmt_bytes(ring["observed"]) if ring["observed"] is not None else "-"
        print(f"ring all-reduce of 1 MiB on 4 ranks, rank {ring['rank']}: equals one process: "
              f"{'yes' if ring['matches'] else 'NO'}; formula 2(N-1)/N·S = {_fmt_bytes(ring['formula'])}; "
              f"on its sockets {seen}")
    if ring["observed"] is not None:                       # the sockets' counters exist (Linux)
        messages = 2 * (4 - 1)                             # a ring all-reduce on 4 ranks: 2(N-1) sends per rank
        extra = ring["observed"] - ring["formula"]
        per_message = extra / messages
        if not every_row:                                  # said once, under section 7's table
            print(f"(the wire's few extra bytes are gloo's framing: {per_message:.0f} B on each of the ring's "
                  f"{messages} messages)")
        claims.check_framing_three_48_byte_headers_a_message(extra, messages)
    if every_row:                                          # the root of a gather or reduce receives most
        print(_root_receives_line(ch00.WORLD_SIZE, ch00.PAYLOAD_BYTES))
    claims.check_collectives_live_4_ranks(rows)
    claims.check_gloo_differs_on_the_wire({r["name"]: r for r in rows})


def _root_receives_line(world_size: int, payload_bytes: int) -> str:
    """Appendix C's bold receives: a gather's root takes (N-1)/N·S, a reduce's (N-1)·S, more than any rank sends."""
    from minipar.course.tour import _fmt_bytes
    gather, reduce = (world_size - 1) * payload_bytes // world_size, (world_size - 1) * payload_bytes
    return (f"(the root receives more than any rank sends: gather (N-1)/N·S = {_fmt_bytes(gather)}, "
            f"reduce (N-1)·S = {_fmt_bytes(reduce)}; that receive limits them)")


def show_traffic(sweep: dict, payload_bytes: int) -> dict:
    """Bytes the busiest rank sends, ring and root, and the ring's messages (steps) per rank, per N (table and
    plot); returns {N: (ring, root)}."""
    s = payload_bytes
    busiest = {n: (max(t["ring"]["sent"]), max(t["root"]["sent"])) for n, t in sweep.items()}
    print(f"{'N':>2}  {'ring: busiest rank':>20}  {'root: busiest rank':>20}  {'total, ring = root':>20}"
          f"  {'ring: messages a rank sent':>26}")
    for n, t in sweep.items():
        ring, root = busiest[n]
        print(f"{n:>2}  {ring / s:>18.3f} S  {root / s:>18.3f} S  {sum(t['ring']['sent']) / s:>18.3f} S"
              f"  {max(t['ring']['sends']):>26}")
    plot_traffic(sweep, s)
    plt.show()
    claims.check_ring_bounded_root_linear(s, busiest, sweep)
    return busiest


def show_ring_time(sizes: dict, sweep: dict, payload_bytes: int) -> None:
    """α (small sizes) and β (large sizes) fitted to a ring all-reduce of 16 B … 16 MiB on 2 ranks, with the model's
    worst miss over all sizes; which term wins at S on the largest N; the fit against S (with the crossover
    S* = N·α·β) and against N (drawn)."""
    alpha, beta = fit_ring(sizes)
    n, big, largest = max(sweep), f"{payload_bytes // 1024} KiB", max(sizes)
    model = {s: ring_model_seconds(FIT_RANKS, s, alpha, beta) for s in sizes}
    miss = {s: max(model[s] / sizes[s], sizes[s] / model[s]) for s in sizes}
    worst = max(sizes, key=miss.get)
    if hasattr(os, "getloadavg"):                          # a loaded machine inflates α: say how loaded it was
        print(f"this machine's load average as the ring ran: {os.getloadavg()[0]:.1f} (1 minute) "
              f"on {machine_cores()} cores")
    print(f"fitted on {FIT_RANKS} ranks: α = {alpha * 1e3:.3f} ms per ring step (sizes ≤ {SMALL_BYTES // 1024} KiB), "
          f"β = {beta / 1e9:.2g} GB/s (sizes ≥ 1 MiB); the model is within {miss[worst]:.1f}× of every size "
          f"(worst at {_size(worst)})")
    steps, data = 2 * (n - 1) * alpha, 2 * (n - 1) / n * payload_bytes / beta
    ratio = max(steps, data) / min(steps, data)
    winner, other = ("steps", "bytes") if steps > data else ("bytes", "steps")
    verdict = (f"the {winner} cost {ratio:.2g}× the {other}, more than the fit's {miss[worst]:.1f}× error, "
               f"so the {winner} dominate" if ratio > miss[worst] else
               f"only {ratio:.1f}× apart, within the fit's {miss[worst]:.1f}× error: too close to call")
    print(f"(model, not measured) at N = {n}, S = {big}: steps 2(N-1)·α = {steps * 1e3:.2f} ms, bytes 2(N-1)/N·S/β = "
          f"{data * 1e3:.2f} ms: {verdict}")
    cores = machine_cores()
    measured = fitted_ranks(sorted(sweep), cores)
    modelled = [m for m in sorted(sweep) if m not in measured]
    print(f"right panel: measured at N = {', '.join(map(str, measured))} (this machine's {cores} cores)"
          + (f"; N = {', '.join(map(str, modelled))} ran in section 8 with more ranks than cores, so there only "
             f"the model is drawn" if modelled else ""))
    plot_ring_time(sizes, sweep, payload_bytes, cores)
    plt.show()
    claims.check_ring_time_fitted_on_two_ranks(sizes, alpha, beta, model[largest])
    claims.check_steps_cost_more_than_bytes(alpha, beta, SMALL_BYTES)


def show_published_links() -> None:
    """The ring all-reduce at N = 8 … 1024 priced with published figures (not measured here): α NCCL's hwLat,
    β the link's peak, both in :func:`show_later_links`' table."""
    print("ring all-reduce, NCCL's α and β = peak (the table above), flat ring (N single-GPU nodes, every step"
          " on this link),\nmodel 2(N-1)·α + 2(N-1)/N·S/β (share of the time in the steps' α)")
    print(f"{'link':34} {'N':>5} {'S = 1 MiB':>19} {'S = 1 GiB':>19} {'S* = N·α·β':>11}")
    rows = published_ring_rows()
    for link, n, by_size in rows:
        cells = [f"{_duration(t):>9} ({share:>4.0%})" for t, share in by_size.values()]
        alpha, beta, _ = PUBLISHED_LINKS[link]
        print(f"{link:34} {n:>5} {cells[0]:>19} {cells[1]:>19} {crossover_bytes(n, alpha, beta) / 2**20:>7,.0f} MiB")
    claims.check_published_ring_grows_with_n(rows)


def show_later_links() -> None:
    """The five links later chapters price (assumed α and share of the peak), beside the α NCCL's tuning table
    charges a ring step: NCCL indexes it by link type (NVLink, PCI, network), not by generation."""
    later = {"NVLink 4": NVLINK4, "InfiniBand NDR": IB_NDR}
    print("NCCL's α: the latency its tuner charges a ring step (hwLat), by link type, not by generation")
    print(f"{'link':32} {'NCCL α':>24} {'course α':>8} {'β peak':>10} {'share':>6} {'course β':>10}")
    for card in (NVLINK3, NVLINK4, PCIE3, IB_HDR, IB_NDR):
        kind = nccl_link_type(card.name)
        nccl = f"{NCCL_RING_LATENCY[kind] * 1e6:.1f} µs (any {kind})" if kind in NCCL_RING_LATENCY else "no row"
        print(f"{card.name:32} {nccl:>24} {card.latency * 1e6:>5.0f} µs {card.bandwidth / 1e9:>5.0f} GB/s"
              f" {card.efficiency:>6.0%} {card.beta / 1e9:>5.0f} GB/s")
    claims.check_effective_beta_below_peak(later, PUBLISHED_LINKS)
    claims.check_card_alpha_below_nccl_table(later, PUBLISHED_LINKS)
    claims.check_nccl_latency_by_link_type(PUBLISHED_LINKS, NCCL_RING_LATENCY)
    claims.check_alpha_used_by_generation((NVLINK3, NVLINK4, PCIE3, IB_HDR, IB_NDR), NCCL_RING_LATENCY,
                                          nccl_link_type)
    claims.check_link_shares_between_77_and_90_percent((NVLINK3, NVLINK4, PCIE3, IB_HDR, IB_NDR))


def _size(nbytes: int) -> str:
    """16 B, 4 KiB, 16 MiB: the sweep's sizes are whole powers of two."""
    for unit, scale in (("MiB", MIB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.1f} ms"


def show_launch_vs_mp(by_hand: list, with_launch: list) -> None:
    print("torch.multiprocessing:", by_hand, "  minipar.launch:", with_launch)
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

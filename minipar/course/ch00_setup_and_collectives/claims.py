"""Chapter 00's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import math

import torch.distributed as dist

from minipar.course.ch00_setup_and_collectives import tour as ch00
from minipar.course.ch00_setup_and_collectives.latency import SMALL_BYTES, nccl_link_type, ring_model_seconds
from minipar.wire import GLOO_HEADER_BYTES     # gloo's TCP transport: a header per write


def check_why_distributed_training_memory(state_bytes, device_bytes) -> None:
    """Why distributed training: memory. GPT-3's 16-bit weights alone are 350 GB (5 devices of 80 GB); its
    training state at 16 B/param is 2.8 TB (35 devices); 1.3 B parameters fit on one device, 7 B do not."""
    devices = {what: math.ceil(b / device_bytes) for what, b in state_bytes.items()}
    assert state_bytes["GPT-3 175B, 16-bit weights only"] == 350e9 and devices["GPT-3 175B, 16-bit weights only"] == 5
    assert state_bytes["GPT-3 175B"] == 2.8e12 and devices["GPT-3 175B"] == 35
    assert devices["1.3B"] == 1 and devices["7B"] > 1, devices


def check_adam_state_bytes_measured(measured, n) -> None:
    """Why distributed training: memory: mixed-precision Adam holds 2 + 2 + 4 + 8 = 16 bytes per parameter"""
    assert measured == {"bf16 weights": 2 * n, "bf16 gradients": 2 * n, "fp32 master weights": 4 * n,
                        "Adam's two moments": 8 * n}


def check_gpt3_month_holds(flops, at_peak, achieved, with_recompute, one_gpu_years) -> None:
    """Why distributed training: compute: "GPT-3 on 1024 A100s takes about a month" holds (11 days at peak,
    34 at Narayanan et al.'s 140 TFLOP/s, which counts recomputation (8·N·D); 25 if all 140 were useful)"""
    assert 3.1e23 < flops < 3.2e23
    assert 10 < at_peak < 13 and 20 < achieved < 30 and 30 < with_recompute < 40
    assert one_gpu_years > 50


def check_no_env_rendezvous(info) -> None:
    """Appendix B, what minipar.launch sets: LOCAL_RANK, but no env:// rendezvous (RANK, MASTER_ADDR unset)"""
    assert [i["rank"] for i in info] == [0, 1, 2, 3] and all(i["world_size"] == 4 and i["backend"] == "gloo" for i in info)
    assert [i["env"]["LOCAL_RANK"] for i in info] == ["0", "1", "2", "3"] and all(i["env"]["RANK"] is None and i["env"]["MASTER_ADDR"] is None for i in info)  # no env:// rendezvous


def check_backends_gloo_nccl_mpi(defaults) -> None:
    """Backends: gloo, NCCL, MPI"""
    assert defaults["cpu"] == "gloo" and defaults["cuda"] == "nccl"
    assert dist.is_gloo_available()


def check_whole_numbers_sums_exact_any_order(diff, name) -> None:
    """The collectives, live on 4 ranks: whole numbers: sums are exact in any order"""
    assert diff == 0, f"{name}: max |diff| = {diff}"


def check_collectives_live_4_ranks(rows) -> None:
    """The collectives, live on 4 ranks: every result equals one process; where gloo runs the formula's
    algorithm the wire carries the formula's bytes plus framing (under 1 %), and a row says where gloo differs
    only where its wire does differ (over 1 %); the log's count of send/recv (real messages) equals the formula"""
    assert all(r["matches"] for r in rows)
    assert all(r["model"] == r["formula"] for r in rows if r["log_counts_sends"])
    for r in (r for r in rows if r["observed"] is not None):
        within = 0 <= r["observed"] - r["formula"] <= 0.01 * r["formula"]
        assert within != bool(r["note"]), r




def check_framing_three_48_byte_headers_a_message(extra, messages) -> None:
    """What each collective sends: where gloo runs the formula's algorithm, the wire carries the formula plus
    gloo's framing, about 150 bytes a message: three 48-byte headers"""
    assert extra == 3 * GLOO_HEADER_BYTES * messages, (extra, messages)


def check_effective_beta_below_peak(cards, published) -> None:
    """Published links: the table's β is the datasheet peak, the same the later chapters' link cards start
    from; their effective β is a share of it"""
    peaks = [beta for _, beta, _ in published.values()]
    assert [c.bandwidth for c in cards.values()] == peaks, (cards, published)
    assert all(0.5 < c.efficiency < 1 for c in cards.values()), cards


def check_card_alpha_below_nccl_table(cards, published) -> None:
    """Published links: the link cards' α (the later chapters') is a rounder, smaller figure than NCCL's
    tuning table, within a factor of two of it"""
    tables = [alpha for alpha, _, _ in published.values()]
    for card, table in zip(cards.values(), tables):
        assert table / 2 <= card.latency < table, (card, table)


def check_alpha_used_by_generation(cards, by_type, kind_of) -> None:
    """Appendix D: the course's α differs within a link type (newer NVLink and InfiniBand smaller), and every
    link's α is within a factor of two of the hwLat NCCL charges its link type"""
    nvlink3, nvlink4, _pcie3, hdr, ndr = cards
    assert nvlink4.latency < nvlink3.latency and ndr.latency < hdr.latency, cards
    for card in cards:
        table = by_type[kind_of(card.name)]
        assert table / 2 <= card.latency <= 2 * table, (card, table)


def check_nccl_latency_by_link_type(published, by_type) -> None:
    """Appendix D: NCCL's hwLat is indexed by link type: the ring step α quoted for NVLink 4 and InfiniBand NDR
    is the one NCCL (2.18-2.30) charges any NVLink (3.4 µs) and any network (14.0 µs); any PCI link costs 5.7 µs"""
    assert by_type == {"NVLink": 3.4e-6, "PCI": 5.7e-6, "network": 14.0e-6}, by_type
    quoted = {nccl_link_type(name): alpha for name, (alpha, _, _) in published.items()}
    assert quoted == {"NVLink": by_type["NVLink"], "network": by_type["network"]}, published


def check_link_shares_between_77_and_90_percent(cards) -> None:
    """Appendix D: the later chapters' links assume a ring reaches 77 % to 90 % of the peak, and α of 3 to 10 µs"""
    assert {round(c.efficiency, 2) for c in cards} == {0.77, 0.80, 0.90}, cards
    assert min(c.latency for c in cards) == 3e-6 and max(c.latency for c in cards) == 10e-6, cards


def check_gloo_differs_on_the_wire(by_name) -> None:
    """The collectives, live on 4 ranks: gloo's broadcast root sends 2·S (a binomial tree), not the formula's
    (N−1)·S = 3·S; gloo's reduce-scatter sends about an all-reduce's 2(N−1)/N·S"""
    S = 2**20
    broadcast, rs = by_name["broadcast"], by_name["reduce_scatter"]
    assert broadcast["rank"] == 0 and broadcast["formula"] == 3 * S
    if broadcast["observed"] is not None:
        assert 2 * S <= broadcast["observed"] <= 2.01 * S, broadcast
        assert 1.5 * S <= rs["observed"] <= 1.52 * S, rs


def check_every_message_worked_out_one_process(steps, N) -> None:
    """Ring all-reduce from send/recv: every message, worked out on one process"""
    assert steps == ch00.expected_ring_messages(N)


def check_ring_sends_2_n_minus_1_messages(same, sends, N, S) -> None:
    """Ring all-reduce from send/recv: 2(N-1) messages of S/N"""
    assert same and len(sends) == 2 * (N - 1) and all(m[1] == S // N for m in sends)


def check_ring_bounded_root_linear(S, busiest, sweep) -> None:
    """Ring vs. one root, as N grows: ring bounded, root linear"""
    assert all(ring == 2 * (n - 1) * S / n <= 2 * S and root == (n - 1) * S for n, (ring, root) in busiest.items())  # ring bounded, root linear
    assert all(t["ring"]["sends"] == [2 * (n - 1)] * n for n, t in sweep.items())  # 2(N-1) steps, counted
    assert all(sum(t["ring"]["sent"]) == sum(t["root"]["sent"]) and max(t["ring"]["max_abs_diff"], t["root"]["max_abs_diff"]) <= ch00.SUM_ATOL for t in sweep.values())  # same total, right sums


def check_ring_time_fitted_on_two_ranks(sizes, alpha, beta, model_at_largest) -> None:
    """Ring vs. one root: α and β are fitted on 2 ranks to sizes spanning six decades (16 B … 16 MiB), the
    largest size takes longer than the smallest (the size effect is measured, not lost in the noise), and the
    model at the largest size is within 1.5× of its measurement (β is fitted there)."""
    assert min(sizes) <= 16 and max(sizes) >= 2 ** 24, sorted(sizes)
    assert sizes[max(sizes)] > sizes[min(sizes)] and alpha > 0 and 0 < beta < float("inf"), (alpha, beta)
    assert ring_model_seconds(8, SMALL_BYTES, alpha, beta) > ring_model_seconds(2, SMALL_BYTES, alpha, beta)
    assert 1 / 1.5 < model_at_largest / sizes[max(sizes)] < 1.5, (model_at_largest, sizes[max(sizes)])


def check_published_ring_grows_with_n(rows) -> None:
    """Published links: a ring's time grows with N at either size; at 1 MiB the steps' α is most of it on every
    link and N, and nearly all of it (over 90 %) on 1024 ranks."""
    by_link = {}
    for link, n, by_size in rows:
        by_link.setdefault(link, []).append((n, by_size))
    for link, entries in by_link.items():
        for size in entries[0][1]:
            times = [by_size[size][0] for _, by_size in sorted(entries)]
            assert times == sorted(times) and len(set(times)) == len(times), (link, size, times)
    assert all(by_size[2 ** 20][1] > 0.5 for _, n, by_size in rows), rows
    assert all(by_size[2 ** 20][1] > 0.9 for _, n, by_size in rows if n == 1024), rows


def check_steps_cost_more_than_bytes(alpha, beta, small_bytes) -> None:
    """Ring vs. one root: at 4 KiB the steps cost more than the bytes — the fitted 2(N−1)/N·S/β is under half
    the 2(N−1)·α of the steps for every N (the ratio is S/(N·α·β), largest at N = 2)."""
    assert small_bytes / (2 * alpha * beta) < 0.5, (alpha, beta)


def check_appendix_minipar_launch_torch_multiprocessing(by_hand, with_launch) -> None:
    """Appendix A. `minipar.launch` and `torch.multiprocessing.spawn`"""
    assert by_hand == with_launch == [6.0, 6.0, 6.0, 6.0]


def check_appendix_b_torchrun_for_real(workers, launched) -> None:
    """Processes, ranks, world size: torchrun, for real (the env values, no NODE_RANK)"""
    n = len(workers)                        # each rank gets the sum of the ranks, 0 + 1 + ... + (n - 1)
    assert n >= 2 and [w["result"] for w in workers] == launched == [float(sum(range(n)))] * n and all(w["env"]["NODE_RANK"] is None and w["env"]["GROUP_RANK"] == "0" for w in workers)


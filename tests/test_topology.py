"""Topology in the α-β model (minipar.machine.cluster): rails (a NIC per GPU, NCCL's rings across all of
them), the hierarchical all-reduce, the tree for small messages, an NVLink domain of 72. Numbers by hand."""
import math

import pytest

from minipar.machine.cluster import (ETH_100G, IB_HDR, NVLINK3, NVLINK5, a100_cluster, allreduce_options,
                                     collective_seconds, comm_seconds, gpu_cluster, link, nccl_allreduce_seconds,
                                     nvl72_cluster)
from minipar.machine.device import A100_SXM_80GB

S = 5.6e9                                     # 1.4 B FP32 gradients: chapter 14's two-node DDP


def test_a_ring_over_two_dgx_nodes_crosses_on_all_eight_rails():
    two = a100_cluster(2)
    assert link(two, range(16)) == (pytest.approx(min(NVLINK3.beta, 8 * IB_HDR.beta)), IB_HDR.latency)
    assert link(two, (0, 8)) == (IB_HDR.beta, IB_HDR.latency)          # one GPU per node: its own NIC
    assert link(two, range(4, 12)) == (pytest.approx(4 * IB_HDR.beta), IB_HDR.latency)     # 4 per node
    ring8 = 30 * IB_HDR.latency + 2 * 15 / 16 * S / (8 * IB_HDR.beta)
    assert comm_seconds("all_reduce", range(16), S, two) == pytest.approx(ring8)            # 59 ms, was 473
    one_nic = gpu_cluster(A100_SXM_80GB, 2, NVLINK3, IB_HDR, rails=1)
    assert comm_seconds("all_reduce", range(16), S, one_nic) > 7 * ring8          # the ring on one NIC: 473 ms
    assert nccl_allreduce_seconds(range(16), S, one_nic) == allreduce_options(range(16), S, one_nic)["hierarchical"]


def test_hierarchical_and_tree_all_reduce():
    eth = gpu_cluster(A100_SXM_80GB, 2, NVLINK3, ETH_100G, rails=1)
    got = allreduce_options(range(16), S, eth)
    inside = 7 * 5e-6 + 7 / 8 * S / NVLINK3.beta                 # reduce-scatter (and all-gather) in the node
    across = 2 * ETH_100G.latency + (S / 8) / (ETH_100G.beta / 8)  # 2 nodes; 8 GPUs share the one NIC
    assert got["hierarchical"] == pytest.approx(2 * inside + across)
    assert got["ring"] == pytest.approx(30 * ETH_100G.latency + 2 * 15 / 16 * S / ETH_100G.beta)
    assert nccl_allreduce_seconds(range(16), S, eth) == min(got.values()) == got["hierarchical"]
    many = a100_cluster(64)                                       # 8 bytes over 512 GPUs: latency decides
    small = allreduce_options(range(512), 8, many)
    assert small["tree"] == pytest.approx(2 * 6 * IB_HDR.latency + 2 * 7 * NVLINK3.latency + 16 / link(many, range(512))[0])
    assert small["tree"] < small["ring"] / 10 and nccl_allreduce_seconds(range(512), 8, many) == small["tree"]


def test_an_nvlink_domain_of_72():
    rack = nvl72_cluster(2)
    assert rack.devices_per_node == 72 and link(rack, range(72)) == (NVLINK5.beta, NVLINK5.latency)
    assert comm_seconds("all_gather", range(72), S, rack) == pytest.approx(
        collective_seconds("all_gather", S, 72, NVLINK5.beta, NVLINK5.latency))
    assert link(rack, range(144))[0] == pytest.approx(min(NVLINK5.beta, 72 * rack.inter_bw))
    assert math.isclose(rack.inter_bw, 0.9 * 50e9)


def test_nccl_broadcast_and_reduce_carry_the_payload_once_not_n_minus_1_times():
    """NCCL pipelines a broadcast or reduce along a ring: the root's link carries ≈S, so the bandwidth term does
    not grow with n (the direct star's (n-1)·S/β does); a group of one moves nothing; other ops are refused."""
    from minipar.machine.cluster import nccl_rooted_seconds
    for op in ("broadcast", "reduce"):
        t8, t64 = (nccl_rooted_seconds(op, S, n, 100e9, 5e-6) for n in (8, 64))
        assert t8 == pytest.approx(7 * 5e-6 + S / 100e9) and t64 - t8 == pytest.approx(56 * 5e-6)
        assert t8 < collective_seconds(op, S, 8, 100e9, 5e-6)
        assert nccl_rooted_seconds(op, S, 1, 100e9, 5e-6) == 0.0
    with pytest.raises(ValueError, match="broadcast or a reduce"):
        nccl_rooted_seconds("all_reduce", S, 8, 100e9, 5e-6)

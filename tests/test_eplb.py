"""The expert-parallel load balancer: DeepSeek's README example reproduced exactly, the plan's invariants, the
two policies, and the busiest GPU's load before and after."""
import pytest
import torch

from minipar.moe.eplb import balanced_packing, gpu_loads, rebalance_experts, replicate

# github.com/deepseek-ai/EPLB, README "Interface and Example": 2 layers x 12 experts, 16 slots, 4 groups,
# 2 nodes, 8 GPUs, and the phy2log it prints.
README_WEIGHT = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = torch.tensor([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                               [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


def test_readme_example_exactly():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert torch.equal(phy2log, README_PHY2LOG)
    # counted in README_PHY2LOG
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    assert log2phy.shape == (2, 12, 2)
    for layer in range(2):                       # log2phy lists exactly the slots phy2log gives each expert
        for e in range(12):
            slots = [s for s in log2phy[layer, e].tolist() if s >= 0]
            assert sorted(slots) == [s for s in range(16) if phy2log[layer, s] == e]


def test_hierarchical_keeps_each_group_on_one_node():
    phy2log, _, _ = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    for layer in range(2):
        node_of_group = {}
        for slot, e in enumerate(phy2log[layer].tolist()):
            node = slot // 8                                     # 16 slots, 2 nodes
            assert node_of_group.setdefault(e // 3, node) == node   # groups of 3 consecutive experts


def test_global_policy_when_nodes_do_not_divide_groups():
    # 3 groups on 2 nodes: groups cannot stay whole, so one group, one node (global replication and packing)
    phy2log, _, logcnt = rebalance_experts(README_WEIGHT, 16, 3, 2, 8)
    same, _, _ = rebalance_experts(README_WEIGHT, 16, 1, 1, 8)
    assert torch.equal(phy2log, same)
    # replication is global: the 4 spare slots go to the 4 largest loads per replica, whatever their group
    assert sorted(logcnt[0].argsort(descending=True)[:4].tolist()) == [1, 4, 5, 10]


def test_replicate_gives_spare_slots_to_the_largest_load_per_replica():
    expert, replica, count = replicate(torch.tensor([10.0, 1.0, 4.0]), 6)
    # 10 -> 5 (second copy), then 5 vs 4: 10 again -> 3.33, then 4 -> 2
    assert expert.tolist() == [0, 1, 2, 0, 0, 2] and replica.tolist() == [0, 0, 0, 1, 2, 1]
    assert count.tolist() == [3, 1, 2]


def test_balanced_packing_fills_the_lightest_pack_with_room():
    pack, rank = balanced_packing(torch.tensor([5.0, 1.0, 4.0, 3.0, 2.0, 6.0]), 2)
    # heaviest first into the lighter pack A (0) or B (1), 3 items each: 6 -> A; 5 -> B (0 < 6); 4 -> B (5 < 6);
    # 3 -> A (6 < 9); 2 -> A (9 = 9: ties go to the lower pack); 1 -> B (A is full)
    assert pack.tolist() == [1, 1, 1, 0, 0, 0] and rank.tolist() == [0, 2, 1, 1, 2, 0]


@pytest.mark.parametrize("groups,nodes,gpus,slots", [(4, 2, 4, 16), (1, 1, 4, 16), (2, 2, 4, 12), (3, 2, 4, 12)])
def test_every_plan_is_a_valid_placement_and_lowers_the_busiest_gpu(groups, nodes, gpus, slots):
    weight = torch.tensor([[500, 3, 40, 61, 104, 20, 39, 4, 73, 56, 183, 86],
                           [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 900, 30]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, slots, groups, nodes, gpus)
    assert phy2log.shape == (2, slots) and (logcnt >= 1).all() and (logcnt.sum(-1) == slots).all()
    assert ((log2phy >= 0).sum(-1) == logcnt).all()
    after = gpu_loads(weight, phy2log, gpus)
    assert torch.allclose(after.sum(-1), weight.double().sum(-1))          # every token still has a GPU
    plain = gpu_loads(weight, torch.arange(12).repeat(2, 1), gpus)          # 12 experts, 3 per GPU, no copies
    assert (after.max(-1).values < plain.max(-1).values).all()


@pytest.mark.parametrize("args,says", [
    ((torch.ones(12), 16, 4, 2, 8), "layers"), ((-torch.ones(1, 12), 16, 4, 2, 8), "negative"),
    ((torch.ones(1, 12), 8, 4, 2, 8), "cannot hold"), ((torch.ones(1, 12), 18, 4, 2, 8), "over 8 GPUs"),
    ((torch.ones(1, 12), 16, 4, 3, 8), "over 3 nodes"), ((torch.ones(1, 12), 16, 5, 1, 8), "5 equal groups"),
    ((torch.ones(1, 12), 16, 4, 0, 8), "num_nodes"),
    ((torch.ones(0, 12), 16, 4, 2, 8), r"one MoE layer and one logical expert, got shape \(0, 12\)"),
    ((torch.ones(1, 0), 16, 4, 2, 8), r"got shape \(1, 0\)"), ((torch.ones(0, 0), 16, 1, 1, 8), "at least one")])
def test_bad_input_is_refused_with_the_reason(args, says):
    with pytest.raises(ValueError, match=says):
        rebalance_experts(*args)

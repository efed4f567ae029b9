"""The expert-parallel load balancer (EPLB): replicate the busiest experts, then pack the replicas onto GPUs so
that every GPU gets about the same load.

Under expert parallelism a GPU's time per MoE layer is set by the tokens its experts receive, and the step
waits for the busiest GPU. Routing is never perfectly even, so DeepSeek-V3 (arXiv:2412.19437, §3.4) deploys
**redundant experts**: R > E physical expert slots, the heavily loaded logical experts held several times,
each replica taking an equal share of that expert's tokens. How to choose and place the replicas is the
algorithm of DeepSeek's ``eplb`` repository (github.com/deepseek-ai/EPLB), written again here. Given w_e, the
measured load of logical expert e (tokens routed to it, per MoE layer), R slots on G GPUs (R/G each) in N
nodes, and the experts in groups of consecutive indices (DeepSeek-V3's group-limited routing):

1. **groups onto nodes** (hierarchical policy, when N divides the number of groups): pack the groups, heaviest
   first, each onto the lightest node that still has room for one (:func:`balanced_packing`), so that a
   token's experts stay within few nodes and the nodes carry about equal loads;
2. **replicate within each node**: the node's R/N slots hold each of its experts once, and every spare slot
   goes to the expert with the largest load per replica w_e / n_e (:func:`replicate`: greedy, it minimises the
   largest replica load);
3. **replicas onto GPUs**: pack the node's replicas, replica load w_e / n_e, onto its G/N GPUs by the same
   balanced packing, R/G per GPU.

Otherwise (the **global** policy) the same with one group and one node: replicate over all R slots, pack onto
all G GPUs. :func:`rebalance_experts` returns ``(phy2log, log2phy, logcnt)`` as the original does: the logical
expert in each physical slot (slot s lives on GPU s // (R/G)), each expert's slots (padded with −1) and each
expert's replica count. :func:`gpu_loads` is the load each GPU then carries (tokens split evenly over an
expert's replicas).
"""
from __future__ import annotations

import torch

__all__ = ["balanced_packing", "replicate", "rebalance_experts", "gpu_loads", "validate"]


def balanced_packing(weights: torch.Tensor, packs: int) -> tuple:
    """Put n items into ``packs`` packs of n/packs items each, as evenly loaded as possible: heaviest item
    first, each into the lightest pack that still has room (ties: the lower pack). With one item per pack
    there is nothing to balance and item i stays in pack i. Returns (pack of each item, its rank in the pack)."""
    n = weights.numel()
    per_pack = n // packs
    if per_pack == 1:
        return torch.arange(n), torch.zeros(n, dtype=torch.long)
    pack, rank = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long)
    load, items = torch.zeros(packs, dtype=weights.dtype), [0] * packs
    for item in weights.sort(descending=True).indices.tolist():     # torch's order of ties, as the original
        p = min((q for q in range(packs) if items[q] < per_pack), key=lambda q: float(load[q]))
        pack[item], rank[item] = p, items[p]
        load[p] += weights[item]
        items[p] += 1
    return pack, rank


def replicate(weights: torch.Tensor, slots: int) -> tuple:
    """Fill ``slots`` ≥ m slots with the m experts: each once, then every spare slot to the expert with the
    largest load per replica w_e / n_e (ties: the lower index). Returns (expert of each slot, which replica of
    its expert the slot holds, replicas per expert)."""
    m = weights.numel()
    expert, replica = list(range(m)), [0] * m
    count = torch.ones(m, dtype=torch.long)
    for _ in range(slots - m):
        e = int((weights / count).argmax())
        expert.append(e)
        replica.append(int(count[e]))
        count[e] += 1
    return torch.tensor(expert), torch.tensor(replica), count


def _place_layer(w: torch.Tensor, slots: int, groups: int, nodes: int, gpus: int) -> tuple:
    """Steps 1–3 for one layer's loads ``w`` (E,): (logical expert, replica) of each of the ``slots`` slots."""
    e = w.numel()
    group_size, per_node, slots_per_node = e // groups, e // nodes, slots // nodes
    # 1. groups onto nodes; node n's experts listed group by group in the order the packing put them there
    group_node, group_rank = balanced_packing(w.view(groups, group_size).sum(-1), nodes)
    first = (group_node * (groups // nodes) + group_rank) * group_size         # position of each group's first expert
    node_order = torch.empty(e, dtype=torch.long)                               # node-major position -> expert
    node_order[(first.unsqueeze(-1) + torch.arange(group_size)).flatten()] = torch.arange(e)
    phy2log, phyrank = [], []
    for node in range(nodes):
        experts = node_order[node * per_node:(node + 1) * per_node]
        # 2. replicate within the node
        local, replica, count = replicate(w[experts], slots_per_node)
        # 3. the node's replicas onto its GPUs: slot = gpu * (slots per GPU) + rank on the GPU
        gpu, rank = balanced_packing((w[experts] / count)[local], gpus // nodes)
        where = gpu * (slots // gpus) + rank
        in_slot_order = torch.empty_like(where)
        in_slot_order[where] = torch.arange(slots_per_node)
        phy2log.append(experts[local[in_slot_order]])
        phyrank.append(replica[in_slot_order])
    return torch.cat(phy2log), torch.cat(phyrank)


def validate(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    """ValueError naming what does not fit."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be (MoE layers, logical experts), got shape {tuple(weight.shape)}")
    if 0 in weight.shape:
        raise ValueError(f"weight must hold at least one MoE layer and one logical expert, got shape "
                         f"{tuple(weight.shape)}")
    if (weight < 0).any():
        raise ValueError("a load cannot be negative: weight holds tokens routed to each expert")
    experts = weight.shape[1]
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                    ("num_gpus", num_gpus)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if num_replicas < experts:
        raise ValueError(f"{num_replicas} physical slots cannot hold {experts} logical experts once each")
    if num_replicas % num_gpus:
        raise ValueError(f"{num_replicas} physical slots do not split evenly over {num_gpus} GPUs")
    if num_gpus % num_nodes:
        raise ValueError(f"{num_gpus} GPUs do not split evenly over {num_nodes} nodes")
    if experts % num_groups:
        raise ValueError(f"{experts} experts do not split into {num_groups} equal groups")


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple:
    """``weight`` (layers, E): each logical expert's load. Hierarchical when ``num_nodes`` divides
    ``num_groups``, else global. Returns phy2log (layers, R), log2phy (layers, E, max replicas; −1 where an
    expert has fewer) and logcnt (layers, E)."""
    validate(weight, num_replicas, num_groups, num_nodes, num_gpus)
    w = weight.float().cpu()
    if num_groups % num_nodes:                                   # groups cannot stay whole on nodes: global
        num_groups = num_nodes = 1
    placed = [_place_layer(row, num_replicas, num_groups, num_nodes, num_gpus) for row in w]
    phy2log = torch.stack([p for p, _ in placed])
    phyrank = torch.stack([r for _, r in placed])
    logcnt = torch.stack([torch.bincount(p, minlength=w.shape[1]) for p in phy2log])
    layers, experts = w.shape
    log2phy = torch.full((layers, experts, int(logcnt.max())), -1, dtype=torch.long)
    for layer in range(layers):
        log2phy[layer, phy2log[layer], phyrank[layer]] = torch.arange(num_replicas)
    return phy2log, log2phy, logcnt


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """(layers, G): the load each GPU carries when expert e's tokens are split evenly over its n_e replicas and
    slot s sits on GPU s // (R/G). With phy2log = arange(E) (no replicas) it is the plain EP placement."""
    w = weight.double()
    count = torch.stack([torch.bincount(p, minlength=w.shape[1]) for p in phy2log]).double()
    per_slot = (w / count).gather(1, phy2log)
    return per_slot.view(w.shape[0], num_gpus, -1).sum(-1)

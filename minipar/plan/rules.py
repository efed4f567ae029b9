"""The source articles' decision guide, as a small rule set: the Hugging Face guide *Efficient Training on
Multiple GPUs* (Chinese edition *在多个 GPU 上高效训练*), section "可扩展性策略", and *9. 总结* §8.

    one device     fits → train as is;  does not fit → ZeRO + offload (CPU, NVMe);
                   largest layer does not fit → ZeRO + memory-centric tiling
    one node       fits → DDP or ZeRO;  does not fit → PP, ZeRO or TP (similar with NVLink; without it
                   PP is faster);  largest layer does not fit → TP (or ZeRO)
    many nodes     fast inter-node links → ZeRO, or PP + TP + DP;
                   slow links and too little memory → DP + PP + TP + ZeRO-1
    always         TP stays inside a node (tp ≤ devices per node); PP does not mix with ZeRO-2/3

The rules look only at whether things fit and how fast the links are; they know nothing of the batch, the
bubble or the sequence length. :func:`minipar.plan.plan` searches layouts with the cost model instead;
chapter 12 puts the two side by side and shows where and why they disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cost import Cluster, Layout, estimate
from .model import Transformer, activation_bytes_per_layer, layer_parameters, model_state_bytes_formula

__all__ = ["Advice", "decide", "family", "FAST_LINK_RATIO"]

FAST_LINK_RATIO = 0.5     # "fast" inter-node links: at least half the bandwidth of the links inside a node


@dataclass
class Advice:
    """The path through the guide (question, answer) and the families of layouts it recommends."""
    path: list = field(default_factory=list)
    families: list = field(default_factory=list)

    def __str__(self) -> str:
        steps = "\n".join(f"  {q} {a}" for q, a in self.path)
        return f"{steps}\n  → {' | '.join(self.families)}"


def family(layout: Layout) -> str:
    """The family of a layout, by the parallelisms it uses: 'DP + ZeRO-1 + TP + PP', 'DDP', ..."""
    parts = []
    if layout.dp > 1 or layout.zero:
        parts.append(f"ZeRO-{layout.zero}" if layout.zero else "DP")
    parts += ["TP"] if layout.tp > 1 else []
    parts += ["PP"] if layout.pp > 1 else []
    parts += ["CP"] if layout.cp > 1 else []
    parts += ["EP"] if layout.ep > 1 else []
    name = " + ".join(parts) or "one device"
    return "DDP" if name == "DP" else name


def decide(model: Transformer, cluster: Cluster, *, precision="mixed", micro_batch: int = 1) -> Advice:
    """Walk the guide for ``model`` on ``cluster``."""
    advice = Advice()
    alone = estimate(model, cluster, Layout(micro_batch=micro_batch), precision=precision)
    fits = alone.fits
    layer = layer_parameters(model)
    layer_bytes = model_state_bytes_formula(layer, 1, 0, precision)["total"] + activation_bytes_per_layer(model, micro_batch)
    layer_fits = layer_bytes <= cluster.memory_bytes
    gb = lambda x: f"{x / 1e9:.1f} GB"  # noqa: E731
    advice.path.append(("fits one device?", f"{'yes' if fits else 'no'} ({gb(alone.memory['total'])} of "
                                           f"{gb(cluster.memory_bytes)})"))
    if not fits:
        advice.path.append(("largest layer fits?", f"{'yes' if layer_fits else 'no'} ({gb(layer_bytes)})"))
    if cluster.devices == 1:
        advice.path.append(("devices?", "one"))
        advice.families = (["one device"] if fits else ["ZeRO + offload"] if layer_fits
                           else ["ZeRO + offload + memory-centric tiling"])
        return advice
    if cluster.nodes == 1:
        advice.path.append(("devices?", f"one node of {cluster.devices_per_node}"))
        if fits:
            advice.families = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
        elif not layer_fits:
            advice.families = ["TP", "ZeRO-3"]
        else:
            advice.families = ["PP", "ZeRO-3", "TP"]
        return advice
    fast = cluster.inter_bw >= FAST_LINK_RATIO * cluster.intra_bw
    advice.path.append(("devices?", f"{cluster.nodes} nodes of {cluster.devices_per_node}"))
    advice.path.append(("fast inter-node links?", f"{'yes' if fast else 'no'} ({cluster.inter_bw / 1e9:.0f} vs "
                                                  f"{cluster.intra_bw / 1e9:.0f} GB/s inside a node)"))
    if fits:
        advice.families = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    elif fast:
        advice.families = ["ZeRO-3", "DP + TP + PP"]
    else:
        advice.families = ["ZeRO-1 + TP + PP"]
    return advice

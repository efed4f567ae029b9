"""Chapter 02's named machines: the Hugging Face guide's TITAN RTX cards (its GPT-2 table was run on two) as
carded clusters (:func:`minipar.machine.cluster.gpu_cluster`), and the guide's table itself (:data:`GUIDE`), which
the chapter's Summary does arithmetic on (:func:`.show.guide_slow_path`). Cards and links are datasheet numbers
with round efficiencies, a model, not measured here.
"""
from __future__ import annotations

import dataclasses

from minipar.machine.cluster import PCIE3, LinkCard, gpu_cluster
from minipar.machine.device import A100_SXM_80GB, DeviceCard

__all__ = ["TITAN_RTX", "TITAN_RTX_FP32", "NVLINK_BRIDGE", "titan_rtx", "GUIDE"]

_ROUND = "launch floor, efficiencies: the A100 card's (minipar.machine.device), not fitted on a TITAN RTX"
TITAN_RTX = DeviceCard(
    "TITAN RTX", 130e12, 672e9, 24e9, A100_SXM_80GB.launch_floor,
    gemm_efficiency=A100_SXM_80GB.gemm_efficiency, attention_efficiency=A100_SXM_80GB.attention_efficiency,
    memory_efficiency=A100_SXM_80GB.memory_efficiency,
    source="NVIDIA Turing architecture whitepaper (2018), TITAN RTX: 130 TFLOP/s FP16 tensor cores with FP32 "
           "accumulate, 16.3 TFLOP/s FP32; 24 GB GDDR6 at 672 GB/s; " + _ROUND)
TITAN_RTX_FP32 = dataclasses.replace(TITAN_RTX, name="TITAN RTX, FP32", peak_flops=16.3e12)
NVLINK_BRIDGE = LinkCard("NVLink bridge (two TITAN RTX)", 50e9, 10e-6, 0.80,
                         "NVIDIA: the TITAN RTX NVLink bridge, 100 GB/s both directions together; latency and "
                         "efficiency: PCIE3's round numbers")


def titan_rtx(devices: int = 2, nvlink: bool = True, fp32: bool = False):
    """Seed 002's machine as a carded cluster (:func:`minipar.machine.cluster.gpu_cluster`): ``devices``
    :data:`TITAN_RTX` in one node over PCIe 3.0 x16 (:data:`minipar.machine.cluster.PCIE3`) or, with
    ``nvlink``, over their NVLink bridge (:data:`NVLINK_BRIDGE`, 50 GB/s per direction). ``fp32``: the card
    at its FP32 peak (:data:`TITAN_RTX_FP32`), for a run without ``--fp16`` (the guide's command line has
    none) instead of its FP16 tensor cores."""
    card = TITAN_RTX_FP32 if fp32 else TITAN_RTX
    link = NVLINK_BRIDGE if nvlink else PCIE3
    return gpu_cluster(card, 1, link, link, devices_per_node=devices)


# The Hugging Face guide's table (GPT-2 small, 2 TITAN RTX, 200 steps, fp32), as chapter 02's Sources box quotes it.
GUIDE = {"params": 124_439_808, "ranks": 2, "steps": 200, "ddp_nvlink_s": 101.9003, "ddp_no_nvlink_s": 131.4367}

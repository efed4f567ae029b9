"""torchft itself beside minipar.fault, where torchft is installed (it is not in minipar's environment: this file
is skipped there; ``pip install torchft`` 0.2.0 — a manylinux wheel with its Rust lighthouse, plus the
opentelemetry packages it imports — runs it).

What ran on this CPU (2026-11-29, torch 2.13 CPU, torchft 0.2.0, gloo): a ``LighthouseServer`` and two replicas of
one rank, each a ``Manager(pg=ProcessGroupGloo(), min_replica_size=2, ...)``, ``start_quorum`` /
``allreduce`` (which averages over the participants) / ``should_commit`` every step: the steps commit and the two
replicas end identical — the test below checks that they equal minipar's one-device reference over the same rows
(≤ 1e-12, float64; about 30-60 s on a loaded 2-core machine: two spawned interpreters import torchft). Only with
``use_async_quorum=False``: with the default (True) both replicas commit every step and end identical, yet
0.058 away from the reference — the quorum of a step is then computed while its forward runs, and some step's
gradient is not the two replicas' mean (not investigated further).
A replica killed mid-run (SIGKILL, 3 replicas): the step in flight is not committed (``should_commit`` false),
as in minipar; but in the probe the next quorum then failed with ``TimeoutError: status: Cancelled, message:
"Timeout expired"`` after the 60 s quorum timeout (min_replicas 2), and with ``min_replicas=1`` the two
survivors each formed a quorum of one and ended with different parameters. The cause was not found in the
time the probe had; minipar's run of the same failure is tests/test_fault_replicas.py.
"""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

torchft = pytest.importorskip("torchft")

from minipar.fault import replicas  # noqa: E402
from minipar.fault.replica import replica_recipe  # noqa: E402
from minipar.recipe import gpt_recipe  # noqa: E402

STEPS, REPLICAS = 3, 2


def tiny_recipe():
    recipe = gpt_recipe(steps=STEPS, batch_size=4, n_layer=1, n_embd=8, n_head=2, seq_len=8)
    recipe.dtype = torch.float64
    return recipe


def torchft_replica(index: int, lighthouse: str, results) -> None:
    torch.set_num_threads(1)
    recipe = replica_recipe(tiny_recipe(), REPLICAS, index)
    model = recipe.model().to(dtype=recipe.dtype)
    optimizer = recipe.optimizer(model.parameters())
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=REPLICAS,
                              load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                              state_dict=lambda: {"model": model.state_dict()}, rank=0, world_size=1,
                              store_addr="localhost", store_port=store.port, lighthouse_addr=lighthouse,
                              replica_id=f"replica{index}", timeout=datetime.timedelta(seconds=30),
                              use_async_quorum=False)
    for inputs, targets in recipe.batches:
        manager.start_quorum()
        optimizer.zero_grad(set_to_none=True)
        recipe.loss(model, inputs, targets).backward()
        for p in model.parameters():
            manager.allreduce(p.grad).wait()              # the mean over the quorum's participants
        if manager.should_commit():
            optimizer.step()
    results.put((index, manager.current_step(), {n: p.detach().clone() for n, p in model.named_parameters()}))
    manager.shutdown()


@pytest.mark.serial
def test_torchft_manager_on_gloo_equals_minipars_one_device_reference():
    from torchft.coordination import LighthouseServer
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=REPLICAS)
    context = mp.get_context("spawn")           # torchft's runtime has threads: no fork
    results = context.Queue()
    procs = [context.Process(target=torchft_replica, args=(i, lighthouse.address(), results)) for i in range(REPLICAS)]
    try:
        for p in procs:
            p.start()
        finals = dict((i, (step, params)) for i, step, params in (results.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    reference = replicas.committed_reference(tiny_recipe(), REPLICAS, [(s, [0, 1]) for s in range(STEPS)])
    for step, params in finals.values():
        assert step == STEPS
        assert max((params[n] - reference.params[n]).abs().max().item() for n in reference.params) <= 1e-12

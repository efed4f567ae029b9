"""Chapters 05 and 06 in the tour: Megatron tensor parallelism, and with sequence parallelism, on 4 ranks.

Each row trains the tiny GPT (2 layers, hidden 32, 4 heads, vocabulary 66 padded to 68, label smoothing
0.1, Adam, 3 steps, float64) with :func:`minipar.tensor.gpt.compare_to_one_device` and compares loss and
every parameter with one device (harness float64 tolerance). Bytes: what one rank sends for one transformer
layer in one forward and backward (b=4, s=16, h=32, float32): the communication log's model and what the
sockets carried (:mod:`minipar.wire`), mean over ranks, next to the formula: 4 all-reduces of b·s·h for TP
(48 KiB); for TP+SP the same volume as all-gathers + reduce-scatters plus the two re-gathers of the
column-parallel inputs in backward (48 + 12 = 60 KiB, as Megatron-LM does it); with the gathered inputs kept
instead (:func:`minipar.tensor.layers.keep_gathered_inputs`) SP's bytes equal TP's, and with its
reduce-scatters on minipar's ring (``with comm.ring_algorithms("reduce_scatter")``; gloo's all-reduces, 2x)
the wire shows it too. The note
gives the measured activation bytes of that layer next to Korthikanti et al.'s count scaled to float32 (+
LayerNorm statistics and the causal mask it leaves out). Peak: one more training step of the whole model
on each rank (model states + the peak the step allocated, max over ranks), next to one device measured the
same way in the note.
"""
from __future__ import annotations

import functools

import torch

from minipar.check import gpt_recipe
from minipar.launcher import launch
from minipar.memory import measure_step
from minipar.mesh import Mesh
from minipar.models import GPTConfig
from minipar.tensor.gpt import TensorParallelGPT, compare_to_one_device
from minipar.tensor.layers import keep_gathered_inputs
from minipar.activations import activation_bytes_formula
from minipar.tensor.sequence import sp_bytes_per_layer, tp_bytes_per_layer, uncounted_bytes
from minipar.course.tour import WORLD_SIZE, TourRow
from minipar.course.tp_layer import measure_layer_on_wire, ring_reduce_scatters

__all__ = ["STRATEGIES"]

B, S, H, A = 4, 16, 32, 4


def _recipe():
    recipe = gpt_recipe(steps=3, batch_size=B, seq_len=S, vocab_size=66, n_embd=H, n_head=A)
    recipe.dtype = torch.float64
    return recipe


def _peak_on_rank(rank, world_size, recipe, sequence_parallel, keep_gathered):
    """Peak live bytes of one more training step of the whole model on this rank (world_size 1: one device)."""
    ref = recipe.model().to(recipe.dtype)
    if world_size == 1:
        model = ref
        step_loss = lambda x, y: recipe.loss(model, x, y)  # noqa: E731
    else:
        group = Mesh(world_size, tp=world_size).build(rank).group("tp")
        model = keep_gathered_inputs(TensorParallelGPT(ref, group, sequence_parallel), keep_gathered)
        step_loss = model.loss
    del ref
    opt = recipe.optimizer(model.parameters())
    x, y = recipe.batches[0]

    def step():
        opt.zero_grad(set_to_none=True)
        step_loss(x, y).backward()
        if world_size > 1:
            model.finish_backward()
        opt.step()
    with ring_reduce_scatters(keep_gathered):                  # the kept row also runs its RS on rings
        measure_step(step, model.parameters(), opt)           # creates the gradients and Adam's state
        opt.zero_grad(set_to_none=True)
        return measure_step(step, model.parameters(), opt).peak


@functools.lru_cache(maxsize=1)
def _one_device_peak() -> int:
    return _peak_on_rank(0, 1, _recipe(), False, False)


def _run(sequence_parallel: bool, keep_gathered: bool = False) -> TourRow:
    recipe = _recipe()
    comparison = compare_to_one_device(recipe, world_size=WORLD_SIZE, sequence_parallel=sequence_parallel,
                                       label_smoothing=0.1, launch_kwargs={"quiet": True})
    if keep_gathered:     # the same arithmetic, another saved tensor: check it trains like one device too
        kept = launch(_train_kept, WORLD_SIZE, recipe, quiet=True)
        from minipar.check import compare, train_reference
        from minipar.tensor.gpt import smoothed_recipe
        c2 = compare(train_reference(smoothed_recipe(recipe, 0.1)), kept, dtype=recipe.dtype)
        comparison_ok, diff = comparison.matches and c2.matches, max(comparison.max_abs_diff, c2.max_abs_diff)
    else:
        comparison_ok, diff = comparison.matches, comparison.max_abs_diff
    per_rank = launch(measure_layer_on_wire, WORLD_SIZE, GPTConfig(n_embd=H, n_head=A), sequence_parallel, keep_gathered,
                      rings=keep_gathered, quiet=True)
    peaks = launch(_peak_on_rank, WORLD_SIZE, recipe, sequence_parallel, keep_gathered, quiet=True)
    mean = lambda i: sum(r[i] for r in per_rank) / len(per_rank)  # noqa: E731
    observed = None if any(r[1] is None for r in per_rank) else mean(1)
    if sequence_parallel:
        formula = sp_bytes_per_layer(S, B, H, WORLD_SIZE, regather=not keep_gathered)
    else:
        formula = tp_bytes_per_layer(S, B, H, WORLD_SIZE)
    act = max(r[3] for r in per_rank)
    act_formula = activation_bytes_formula(S, B, H, A, t=WORLD_SIZE, sequence_parallel=sequence_parallel,
                                           value_bytes=4, dropout=False)
    act_formula += uncounted_bytes(S, B, WORLD_SIZE, sequence_parallel)
    name = "tensor parallel + sequence parallel" if sequence_parallel else "tensor parallel (Megatron)"
    if keep_gathered:
        name += ", inputs kept, ring RS"
    why = {(False, False): "4 all-reduces",
           (True, False): "4 all-gathers + 4 reduce-scatters (= TP's 4 all-reduces) + 2 re-gathers of the QKV "
                          "and fc inputs in backward (+12 KiB), which save keeping the gathered inputs",
           (True, True): "the gathered QKV and fc inputs kept for backward: no re-gather, TP's bytes exactly, "
                         "for more activation memory; its reduce-scatters on minipar's send/recv ring, so that "
                         "the wire shows TP's bytes too (gloo's would all-reduce: 2x)"}[(sequence_parallel, keep_gathered)]
    if sequence_parallel and not keep_gathered:
        why += ("; on the wire more: gloo's reduce-scatter all-reduces (the 4 reduce-scatters move 2x, +12 KiB) "
                "and gloo frames each small message (~1.7 KiB a call)")
    elif keep_gathered:
        why += "; on the wire + gloo's headers"
        act_formula += 2 * (WORLD_SIZE - 1) / WORLD_SIZE * S * B * H * 4   # the two gathered inputs, kept whole
    else:
        why += "; on the wire + gloo's framing (~1.7 KiB per all-reduce)"
    one = _one_device_peak()
    return TourRow(strategy=f"{name}, tp={WORLD_SIZE}", world_size=WORLD_SIZE, matches=comparison_ok,
                   max_abs_diff=diff, bytes_sent_per_rank=mean(0), bytes_formula=formula,
                   peak_bytes_per_rank=max(peaks),
                   note=f"bytes per layer per step: {why}; activations per layer {act} B (formula "
                        f"{act_formula:.0f} B); peak of a whole-model step {max(peaks)} B/rank vs one device "
                        f"{one} B (measured alike)",
                   bytes_observed_per_rank=observed, calls_per_rank=mean(2))


def _train_kept(rank, world_size, recipe):
    """minipar.tensor.gpt.parallel_train with SP, the gathered inputs kept and the reduce-scatters on rings
    (label smoothing 0.1)."""
    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    model = keep_gathered_inputs(TensorParallelGPT(recipe.model().to(recipe.dtype), group, True))
    with ring_reduce_scatters():
        return _train_sp(model, recipe)


def _train_sp(model, recipe):
    """Train a TensorParallelGPT on the recipe's batches (label smoothing 0.1): its RunResult."""
    from minipar.check import RunResult
    opt = recipe.optimizer(model.parameters())
    losses = []
    for inputs, targets in recipe.batches:
        opt.zero_grad(set_to_none=True)
        loss = model.loss(inputs, targets, 0.1)
        loss.backward()
        model.finish_backward()
        opt.step()
        losses.append(loss.item())
    return RunResult(losses, model.full_state_dict())


def _train_collective_matmul(rank, world_size, recipe):
    """The SP TP GPT with every sequence-parallel linear a collective matmul (async TP,
    :mod:`minipar.tensor.collective_matmul`), label smoothing 0.1."""
    from minipar.tensor.collective_matmul import use_collective_matmul
    group = Mesh(world_size, tp=world_size).build(rank).group("tp")
    return _train_sp(use_collective_matmul(TensorParallelGPT(recipe.model().to(recipe.dtype), group, True)), recipe)


def _layer_bytes_collective_matmul(rank, world_size):
    from minipar.tensor.collective_matmul import use_collective_matmul
    from minipar.tensor.measure import measure_layer
    res = measure_layer(rank, world_size, GPTConfig(n_embd=H, n_head=A), B, S, True, prepare=use_collective_matmul)
    return res["bytes_sent"], res["bytes_observed"], res["calls"]


def _collective_matmul() -> TourRow:
    """TP + SP with the all-gather + GEMM and GEMM + reduce-scatter decomposed into ring steps whose transfers
    run under the previous step's GEMM: equal to one device; the same bytes per layer as SP."""
    from minipar.check import compare, train_reference
    from minipar.tensor.gpt import smoothed_recipe
    recipe = _recipe()
    runs = launch(_train_collective_matmul, WORLD_SIZE, recipe, quiet=True)
    c = compare(train_reference(smoothed_recipe(recipe, 0.1)), runs, dtype=recipe.dtype)
    per_rank = launch(_layer_bytes_collective_matmul, WORLD_SIZE, quiet=True)
    sent = [s for s, _, _ in per_rank]
    seen = [o for _, o, _ in per_rank]
    observed = None if None in seen else sum(seen) / len(seen)
    formula = sp_bytes_per_layer(S, B, H, WORLD_SIZE, regather=True)
    note = ("every sequence-parallel linear a collective matmul: p ring steps, each shard's send posted before "
            "the step's GEMM and waited after it (forward), the X re-gather under the dX GEMM and dX's "
            "reduce-scatter under the dW GEMM (backward, Megatron's order); bytes per layer = SP's "
            "(48 + 12 KiB), all as point-to-point sends")
    return TourRow(strategy=f"tensor parallel + SP, collective matmul (async TP), tp={WORLD_SIZE}", world_size=WORLD_SIZE,
                   matches=c.matches, max_abs_diff=c.max_abs_diff, bytes_sent_per_rank=sum(sent) / len(sent),
                   bytes_formula=formula, peak_bytes_per_rank=None, note=note, bytes_observed_per_rank=observed,
                   calls_per_rank=sum(c for _, _, c in per_rank) / len(per_rank))


STRATEGIES = [("tensor parallel", functools.partial(_run, False)),
              ("tensor parallel + sequence parallel", functools.partial(_run, True)),
              ("tensor parallel + sequence parallel, inputs kept, ring RS", functools.partial(_run, True, True)),
              ("tensor parallel + SP, collective matmul", _collective_matmul)]

"""Chapter 09 in the tour: expert parallelism on 4 ranks (``moe-ep``), equal to the same MoE on one device.

The row trains the MoE tiny GPT (2 layers, hidden 32, both FFNs replaced by 4 experts, top-1, capacity
factor 4 = E/k, load-balancing α = 0.01, Adam, 3 steps, global batch 8 × 16 tokens, float32) with one expert
per rank (ep = 4) and compares loss and every parameter with one device (float32 tolerance of
:mod:`minipar.check`). Capacity factor E/k gives C = T slots per expert: no token can be dropped, the
condition for equality (with dropping, a rank fills its slots from its own T tokens, one device from the
whole batch's, and they drop different tokens). The row also counts the drops (0).

Bytes: the all-to-alls only (dispatch and combine, forward and backward), per rank per optimizer step,
over the 2 MoE layers: the communication log's model (the padded buffers' chunks for the 3 other ranks),
beside what the sockets carried (:mod:`minipar.wire`), beside the formula: 2·k·cf·T·M·b per direction per
layer (T = 32 tokens per rank, M = 32, b = 4), two directions, times (ep−1)/ep — the chunk a rank keeps for
its own expert does not cross the wire. Peak memory: one more training step on rank 0.

Beside it: shared + fine-grained experts, loss-free balancing, **dropless** EP under a planted imbalance (every
token to one expert: 0 dropped; :mod:`minipar.moe.dropless`) and the **all-gather dispatcher**
(:mod:`minipar.moe.allgather`) and **expert-TP 2** (:mod:`minipar.moe.expert_tp`), each against one device.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minipar import comm
from minipar.check import compare, train_reference
from minipar.launcher import launch
from minipar.loop import shard_batch
from minipar.memory import measure_step
from minipar.moe import expert_parallel as epm
from minipar.moe.layer import moe_recipe
from minipar.course.tour import WORLD_SIZE, TourRow

EP, CF, BATCH, SEQ = 4, 4.0, 8, 16


def recipe(dtype=torch.float32):
    return moe_recipe(steps=3, batch_size=BATCH, seq_len=SEQ, experts=4, k=1, capacity_factor=CF, alpha=1e-2,
                      dtype=dtype)


def _rank(rank, world_size, recipe, ep, strategy=epm):
    """``strategy``: a module with ``parallel_train`` and ``build`` (padded :mod:`~minipar.moe.expert_parallel`,
    or :mod:`~minipar.moe.dropless`)."""
    step_log = comm.CommLog()
    routings: list = []
    result = strategy.parallel_train(rank, world_size, recipe, ep=ep, step_log=step_log, routings=routings)
    a2a = step_log.select(op="all_to_all", dims=("ep",))          # the EP group's exchanges, from the log
    dropped = sum(d for layers in routings for _, d in layers)
    model, _, mesh = strategy.build(rank, world_size, recipe, ep)
    opt = recipe.optimizer(model.parameters())
    x, y = shard_batch(recipe.batches[0], rank, world_size)

    def step():
        epm.train_step(model, recipe, x, y, 1, mesh, world_size)
        opt.step()
    peak = measure_step(step, model.parameters(), opt).peak
    dist.barrier()
    return result, a2a.bytes_sent / recipe.steps, (a2a.observed_bytes_sent or 0) / recipe.steps, dropped, peak, \
        a2a.count("all_to_all") // recipe.steps


def run() -> TourRow:
    r = recipe()
    reference = train_reference(r)
    out = launch(_rank, WORLD_SIZE, r, EP, quiet=True)
    c = compare(reference, [o[0] for o in out])
    cfg, moe = r.model().cfg, r.model().moe
    layers = len(r.model().moe_layers())
    tokens = BATCH // WORLD_SIZE * SEQ
    per_layer = epm.predicted_all_to_all_bytes(tokens, cfg.n_embd, moe, EP)
    payload = 2 * per_layer["formula"] * layers                  # 2·k·cf·T·M·b per direction, 2 directions
    formula = payload * (EP - 1) / EP                            # an all-to-all keeps 1/ep of its payload
    modelled = sum(o[1] for o in out) / len(out)
    observed = sum(o[2] for o in out) / len(out)
    calls = out[0][5]
    drops = sum(o[3] for o in out)
    framing = (observed - modelled) / (calls * (EP - 1)) if observed else float("nan")
    note = (f"ep={EP}, 1 expert/rank, top-1, cf {CF:g} (C = T): {drops} tokens dropped; all-to-all only, "
            f"{calls} per step (2 per MoE layer forward, 2 backward). Formula = {layers} layers x 2 directions x "
            f"2·k·cf·T·M·b = {payload:,.0f} B x (ep-1)/ep: a rank's chunk for its own expert never leaves it. "
            f"Observed - model = {framing:.0f} B per peer per all-to-all: gloo's send-ready, recv-ready and "
            f"data messages, each with a preamble")
    return TourRow("moe-ep", WORLD_SIZE, c.matches and drops == 0, c.max_abs_diff, modelled, formula,
                   max(o[4] for o in out), note=note, bytes_observed_per_rank=observed or None,
                   calls_per_rank=calls)


def shared_fine_grained() -> TourRow:
    """DeepSeekMoE's layer under EP: one shared expert every token passes through (dense, on every rank) and 8
    routed experts of half width (granularity 2), top-2, no-drop capacity, ep 4, float64, against one device;
    bytes of the all-to-alls from the log beside the formula (per direction 2·k·cf·T·M·b)."""
    import torch
    from minipar.moe.layer import no_drop_capacity_factor
    cf = no_drop_capacity_factor(8, 2)
    r = moe_recipe(steps=3, batch_size=BATCH, seq_len=SEQ, experts=8, k=2, shared=1, granularity=2,
                   capacity_factor=cf, alpha=1e-2, dtype=torch.float64)
    epm.validate(r, world_size=WORLD_SIZE, ep=EP)
    out = launch(_rank, WORLD_SIZE, r, EP, quiet=True)        # one launch: the training compared and its bytes
    c = compare(train_reference(r), [o[0] for o in out], dtype=torch.float64)
    cfg, moe = r.model().cfg, r.model().moe
    layers = len(r.model().moe_layers())
    per_layer = epm.predicted_all_to_all_bytes(BATCH // WORLD_SIZE * SEQ, cfg.n_embd, moe, EP, element_size=8)
    formula = 2 * per_layer["formula"] * layers * (EP - 1) / EP
    modelled = sum(o[1] for o in out) / len(out)
    note = (f"1 shared expert (dense: every rank, every token) + 8 routed experts of half width, top-2, cf {cf:g} "
            f"(no drop), ep={EP}: 2 routed experts per rank; compared with one device in float64; all-to-all bytes "
            f"= {layers} layers x 2 directions x 2·k·cf·T·M·b x (ep-1)/ep")
    return TourRow("moe-ep shared + fine-grained", WORLD_SIZE, c.matches, c.max_abs_diff, modelled, formula,
                   max(o[4] for o in out), note=note, bytes_observed_per_rank=sum(o[2] for o in out) / len(out) or None,
                   calls_per_rank=out[0][5])


def loss_free() -> TourRow:
    """DeepSeek-V3's auxiliary-loss-free balancing under EP (ep 4): no aux loss (alpha 0), a routing bias moved by
    γ·sign(mean load − load) after every step from the whole batch's load (an all-reduce of E counts), float64,
    against one device moving its bias the same way (:func:`minipar.moe.expert_parallel.loss_free_reference`)."""
    import torch
    from minipar.moe.expert_parallel import loss_free_reference
    from minipar.moe.layer import MoEConfig, MoEGPT
    r = moe_recipe(steps=4, batch_size=BATCH, seq_len=SEQ, experts=4, k=1, capacity_factor=CF, alpha=0.0,
                   dtype=torch.float64)
    cfg, moe = r.model().cfg, MoEConfig(experts=4, k=1, capacity_factor=CF, alpha=0.0, bias_rate=0.05)
    r.model = lambda: MoEGPT(cfg, moe)
    reference, biases = loss_free_reference(r)
    c = compare(reference, epm.run(r, world_size=WORLD_SIZE, ep=EP), dtype=torch.float64)
    note = (f"no balancing loss; each MoE layer's routing bias (γ = {moe.bias_rate}) moved after every step from "
            f"the whole batch's load, every rank alike (an all-reduce of E counts per layer); compared with one "
            f"device moving its bias the same way; biases at the end: "
            + "; ".join(" ".join(f"{v:+.2f}" for v in b.tolist()) for b in biases))
    return TourRow("moe-ep loss-free balancing", WORLD_SIZE, c.matches, c.max_abs_diff, None, None, None, note)


def planted_recipe(dropless_layers: bool = True, capacity_factor: float = CF):
    """The row's MoE with a planted worst case: every token's choice is expert 0 (a routing bias of 1e3 on it, moved
    by a loss-free rate of 1e-9, too small to matter), no balancing loss."""
    import torch
    from minipar.moe.layer import MoEConfig, MoEGPT
    r = moe_recipe(steps=3, batch_size=BATCH, seq_len=SEQ, experts=4, k=1, alpha=0.0, capacity_factor=capacity_factor)
    cfg = r.model().cfg
    moe = MoEConfig(experts=4, k=1, capacity_factor=capacity_factor, alpha=0.0, bias_rate=1e-9, dropless=dropless_layers)

    def model():
        m = MoEGPT(cfg, moe)
        for layer in m.moe_layers():
            layer.routing_bias[0] = 1e3
        return m
    r.model, r.dtype = model, torch.float32
    return r


def _dropless_then_padded(rank, world_size, recipe, padded_recipe, ep):
    from minipar.moe import dropless
    return _rank(rank, world_size, recipe, ep, dropless), _rank(rank, world_size, padded_recipe, ep)


def dropless_row() -> TourRow:
    """Dropless EP (:mod:`minipar.moe.dropless`) under the planted imbalance, ep 4, float32, against one device: 0
    dropped where the padded layers with cf 1.25 drop 22 of a rank's 32 tokens per layer; bytes from the log beside
    the formula from the routing's counts (:func:`~minipar.moe.dropless.predicted_exchange_bytes`)."""
    import torch
    from minipar.moe import dropless
    from minipar.moe.expert_parallel import loss_free_reference
    r = planted_recipe()
    reference, _ = loss_free_reference(r)
    both = launch(_dropless_then_padded, WORLD_SIZE, r, planted_recipe(False, 1.25), EP, quiet=True)   # one launch
    out, padded = [o[0] for o in both], [o[1] for o in both]
    c = compare(reference, [o[0] for o in out])
    padded_drops = sum(o[3] for o in padded)
    drops = sum(o[3] for o in out)
    layers, tokens, width = len(r.model().moe_layers()), BATCH // WORLD_SIZE * SEQ, r.model().cfg.n_embd
    counts = torch.zeros(EP, 4, dtype=torch.long)
    counts[:, 0] = tokens                                         # every rank's T tokens to expert 0 (rank 0's)
    exchange = dropless.predicted_exchange_bytes(counts, width, EP)
    rows = 2 * (exchange["dispatch"] + exchange["combine"]).double().mean()   # fwd + bwd, both directions
    formula = layers * (float(rows) + 4 * 8 * (EP - 1) / EP)     # + the split sizes: E/ep int64 to each peer
    note = (f"ep={EP}, every token planted on expert 0 (rank 0's): {drops} dropped (padded cf 1.25: {padded_drops}); "
            f"per layer per step 1 split-size exchange (1 host sync) + 4 uneven all-to-alls; rank 0 receives "
            f"3·T rows and sends 0 in dispatch, the others send T; mean over ranks = 4·k·T·M·b·(ep-1)/ep per layer, "
            f"as under uniform routing (k·T·M·b·(ep-1)/ep per exchange), + E·8·(ep-1)/ep B of counts")
    return TourRow("moe-ep dropless", WORLD_SIZE, c.matches and drops == 0 and padded_drops > 0, c.max_abs_diff,
                   sum(o[1] for o in out) / len(out), formula, max(o[4] for o in out), note=note,
                   bytes_observed_per_rank=sum(o[2] for o in out) / len(out) or None, calls_per_rank=out[0][5])


def _allgather_rank(rank, world_size, recipe, ep):
    from minipar.moe import allgather
    step_log = comm.CommLog()
    result = allgather.parallel_train(rank, world_size, recipe, ep=ep, step_log=step_log)
    records = [r for r in step_log.select(dims=("ep",)).records if r.op in ("all_gather", "reduce_scatter")]
    observed = sum(r.observed_sent or 0 for r in records)
    scattered = sum(r.sent_bytes for r in records if r.op == "reduce_scatter")
    return (result, sum(r.sent_bytes for r in records) / recipe.steps, observed / recipe.steps,
            len(records) // recipe.steps, scattered / recipe.steps)


def allgather_row() -> TourRow:
    """The all-gather token dispatcher (:mod:`minipar.moe.allgather`), ep 4, dropless, top-2 of 4 experts, float32,
    against one device; bytes of its all-gathers and reduce-scatters from the log beside the formula, and beside
    what the all-to-all dispatcher would send under uniform routing (ep/k times less)."""
    from minipar.moe import allgather
    k = 2
    r = moe_recipe(steps=3, batch_size=BATCH, seq_len=SEQ, experts=4, k=k, alpha=1e-2, dropless=True)
    out = launch(_allgather_rank, WORLD_SIZE, r, EP, quiet=True)
    c = compare(train_reference(r), [o[0] for o in out])
    layers, tokens, width = len(r.model().moe_layers()), BATCH // WORLD_SIZE * SEQ, r.model().cfg.n_embd
    bytes_ = {n: layers * v for n, v in allgather.predicted_bytes(tokens, width, k, 4, EP).items()}
    note = (f"ep={EP}, top-{k}, dropless: every rank all-gathers the group's tokens, gates and expert ids, runs its "
            f"expert on the token-choices routed to it, reduce-scatters the outputs; no split sizes, no host sync, "
            f"the same bytes whatever the routing. Formula {layers} layers x (4·(ep-1)·T·M·b + gates + ids) = "
            f"{bytes_['allgather']:,.0f} B; the all-to-all dispatcher: {bytes_['alltoall']:,.0f} B under uniform "
            f"routing (ep/k = {EP / k:g} x less): the all-gather pays when k ≥ ep, or where latency rules")
    observed = sum(o[2] for o in out) / len(out)
    if observed:      # gloo's reduce-scatter is an all-reduce: its ring bytes twice on the wire
        extra = observed - sum(o[1] + o[4] for o in out) / len(out)
        note += (f". Wire: gloo's reduce-scatter all-reduces, so its {sum(o[4] for o in out) / len(out):,.0f} B go "
                 f"out twice; the rest, {extra:,.0f} B, is framing ({extra / (out[0][3] * (EP - 1)):.0f} B per peer "
                 f"per call)")
    return TourRow("moe all-gather dispatch", WORLD_SIZE, c.matches, c.max_abs_diff, sum(o[1] for o in out) / len(out),
                   bytes_["allgather"], None, note=note, bytes_observed_per_rank=observed or None,
                   calls_per_rank=out[0][3])


def _expert_tp_rank(rank, world_size, recipe, ep, tp):
    from minipar.moe import expert_tp
    step_log = comm.CommLog()
    result = expert_tp.parallel_train(rank, world_size, recipe, ep=ep, tp=tp, step_log=step_log)
    moved = step_log.select(dims=("tp",))
    records = [r for r in moved.records if r.op in ("all_gather", "reduce_scatter")]
    return (result, sum(r.sent_bytes for r in records) / recipe.steps,
            sum(r.observed_sent or 0 for r in records) / recipe.steps, len(records) // recipe.steps)


def expert_tp_row() -> TourRow:
    """Expert-TP 2 (:mod:`minipar.moe.expert_tp`): ep 2 × tp 2, each expert's FFN split over its 2 tp ranks, the
    row's MoE (4 experts, top-1, cf 4) in float64 against one device; bytes of the tp all-gathers and reduce-scatters
    from the log beside the formula. float64, not the other rows' float32: splitting each expert's hidden units
    over tp sums its output in another order, and Adam turns float32's rounding of near-zero gradients into weight
    differences just over float32's tolerance on some CPUs (2.2e-05 against 2e-05 seen); in float64 the row agrees to
    9e-14, so the split itself is exact up to rounding."""
    ep, tp = 2, 2
    r = recipe(torch.float64)
    out = launch(_expert_tp_rank, WORLD_SIZE, r, ep, tp, quiet=True)
    c = compare(train_reference(r), [o[0] for o in out])
    layers, tokens, width = len(r.model().moe_layers()), BATCH // WORLD_SIZE * SEQ, r.model().cfg.n_embd
    slots = 4 // ep * ep * tokens                               # local experts × ep·C slots, C = T (cf = E/k)
    value = torch.empty((), dtype=r.dtype).element_size()
    formula = layers * 4 * (tp - 1) * slots * width * value      # all-gather + reduce-scatter, forward + backward
    note = (f"ep={ep} x expert-TP={tp}: each rank holds half the hidden units of its EP rank's 2 experts; the slots the "
            f"all-to-all brought are all-gathered over tp, each half-expert runs on all of them, the partial outputs "
            f"are reduce-scattered. tp bytes = {layers} layers x 4 x (tp-1) x E/ep·ep·C·M·b (C = T = {tokens}, b = {value}: "
            f"float64); the "
            f"EP all-to-alls as in the moe-ep row. Wire: gloo's reduce-scatter all-reduces (2x)")
    observed = sum(o[2] for o in out) / len(out)
    return TourRow("expert-TP 2", WORLD_SIZE, c.matches, c.max_abs_diff, sum(o[1] for o in out) / len(out), formula,
                   None, note=note, bytes_observed_per_rank=observed or None, calls_per_rank=out[0][3])


STRATEGIES = [("moe-ep", run), ("moe-ep shared + fine-grained", shared_fine_grained),
              ("moe-ep loss-free balancing", loss_free), ("moe-ep dropless", dropless_row),
              ("moe all-gather dispatch", allgather_row), ("expert-TP 2", expert_tp_row)]

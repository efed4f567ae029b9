"""Chapter 09b's printed tables of §2 (five dimensions on 16 ranks), each one value: a
:class:`minipar.course.report.Report` whose text the cell prints and whose ``check()`` asserts what the chapter's
sentences say about its numbers. ``five`` is :func:`.five_d.run_chapter`'s dict (one launch feeds them all)."""
from __future__ import annotations

import torch

from minipar.check import compare, train_reference
from minipar.course.report import Report
from minipar.hybrid.parallel3d import bytes_formula
from minipar.memory import tensor_bytes
from minipar.mesh import DEFAULT_ORDER, Mesh, megatron_order

from .five_d import ops_by_dims

__all__ = ["KINDS", "groups_asked", "ops_table", "node_crossing", "memory_1_8_16", "loss_across_layouts",
           "moe_groups", "moe_bytes", "moe_memory"]

KINDS = ("dp", "pp", "cp", "tp")
GROUP_KEYS = (("dp,cp", ("dp", "cp")), ("tp", ("tp",)), ("pp", ("pp",)), ("cp", ("cp",)))
WHAT = {("all_reduce", ("dp", "cp")): "dense gradients (DDP buckets) + the loss, averaged",
        ("all_reduce", ("tp",)): "row-parallel partial sums (g), f's backward, the vocab loss's 3 sums",
        ("send", ("cp",)): "K and V blocks around the ring, their gradients back",
        ("send", ("pp",)): "activations to the next stage, their gradients back"}


def _coords(mesh, rank):
    return " ".join(f"{d}{c}" for d, c in mesh.coords(rank).items() if mesh.sizes[d] > 1)


def mean_bytes(runs, kinds=KINDS) -> dict:
    return {k: sum(r.bytes_by_kind.get(k, 0) for r in runs) / len(runs) for k in kinds}


def _check_groups(r: Report) -> None:
    for rank, seen in enumerate(r.groups):
        for key, dims in GROUP_KEYS:
            assert seen[key][0] == r.mesh.group_ranks(dims, rank) and seen[key][1] == sum(seen[key][0])
        assert seen["dp,cp"][0] in r.dense


def groups_asked(five: dict, mesh: Mesh, dense_groups: list) -> Report:
    """§2.1: each running rank's groups as torch reports them (the sum of rank ids over each proves the members)."""
    lines = [f"{'rank':>4} {'coords':>15} | {'dp×cp (grads)':>15} {'tp':>8} {'pp':>8} {'cp':>8}"]
    for rank, seen in enumerate(five["groups"]):
        lines.append(f"{rank:>4} {_coords(mesh, rank):>15} | " + " ".join(
            f"{str(seen[k][0]):>{w}}" for k, w in (("dp,cp", 15), ("tp", 8), ("pp", 8), ("cp", 8))))
    return Report("\n".join(lines), _check_groups, groups=five["groups"], mesh=mesh, dense=dense_groups)


def _check_ops(r: Report) -> None:
    assert set(r.ops) == set(WHAT)
    grads_payload = r.ops[("all_reduce", ("dp", "cp"))][1] - 8 * 0.5     # the loss: 8 B on the last stage's half
    assert abs(r.mean["dp"] - 2 * 3 / 4 * grads_payload) < 1e-9 * r.mean["dp"]   # ring over 4: 2(n−1)/n
    assert r.mean["pp"] == r.ops[("send", ("pp",))][1] and r.mean["cp"] == r.ops[("send", ("cp",))][1]


def ops_table(five: dict, mesh: Mesh, step: int = 1) -> Report:
    """§2.1: what travelled over each group in one traced step (calls and payload per rank, mean over ranks)."""
    ops = ops_by_dims(five["trace"], mesh, step=step)
    lines = [f"{op:>10} over {' × '.join(dims):>7}: {calls:5.1f} calls, {payload:8.0f} B payload per rank — "
             f"{WHAT.get((op, dims), '?')}" for (op, dims), (calls, payload) in ops.items()]
    return Report("\n".join(lines), _check_ops, ops=ops, mean=mean_bytes(five["runs64"]))


def _check_crossing(r: Report) -> None:
    assert not any(r.crossing[n]["tp"] or r.crossing[n]["cp"] for n in r.crossing)
    assert r.over["pp outermost (Megatron)"] == r.mean["pp"] < r.over["dp outermost (minipar)"] == r.mean["dp"]
    assert r.calls["tp"] > r.calls["cp"] > r.calls["pp"] > r.calls["dp"]


def node_crossing(runs16: list, layout) -> Report:
    """§2.2: calls and bytes per rank per step by dimension, and which cross a node boundary (8 devices per node)
    in minipar's order (dp outermost) and Megatron-Core's (pp outermost; torchtitan's alike)."""
    orders = {"dp outermost (minipar)": DEFAULT_ORDER, "pp outermost (Megatron)": megatron_order("tp-cp-ep-dp-pp")}
    mean = mean_bytes(runs16)
    calls = {k: sum(r.calls_by_kind[k] for r in runs16) / len(runs16) for k in KINDS}
    crossing = {}
    for name, order in orders.items():
        m = Mesh(layout.world_size, order, devices_per_node=8, **layout.sizes)
        crossing[name] = {k: m.crosses_nodes(m.group_ranks(("dp", "cp") if k == "dp" else k, 0)) for k in KINDS}
    lines = [f"{'dim':>6} {'calls':>6} {'bytes sent':>11} | " + " | ".join(f"{n:>23}" for n in orders)]
    for k in ("tp", "cp", "pp", "dp"):
        lines.append(f"{'dp×cp' if k == 'dp' else k:>6} {calls[k]:6.1f} {mean[k]:11.0f} | " + " | ".join(
            f"{'crosses nodes' if crossing[n][k] else 'inside a node':>23}" for n in orders))
    over = {n: sum(mean[k] for k in KINDS if crossing[n][k]) for n in orders}
    lines += [f"{n}: {b:.0f} B per rank per step cross the slow link" for n, b in over.items()]
    lines.append(f"pp outermost sends {over['dp outermost (minipar)'] / over['pp outermost (Megatron)']:.1f}× fewer "
                 f"bytes between nodes")
    return Report("\n".join(lines), _check_crossing, crossing=crossing, over=over, mean=mean, calls=calls)


def _check_memory(r: Report) -> None:
    s1, s8, s16 = r.states
    assert s16 == s8 < s1 / 3 and r.peaks[2] < r.peaks[1]
    assert r.act16 < r.act8
    b8, b16 = r.sent[1], r.sent[2]
    assert b16["tp"] == b8["tp"] / 2 and b16["pp"] == b8["pp"] / 2 and b16["dp"] == 1.5 * b8["dp"]


def memory_1_8_16(one_device: list, runs8: list, runs16: list, tracked16: list, recorded16: bool = False) -> Report:
    """§2.4: model states and a step's peak per rank (max over the ranks that measured it) and bytes sent per
    rank per step, for one device, dp 2 × pp 2 × tp 2 and dp 2 × pp 2 × cp 2 × tp 2 (``recorded16``: its row
    comes from the record, and says so)."""
    rows = {"1 rank": (one_device, one_device), "8 ranks dp2 pp2 tp2": (runs8, runs8),
            "16 ranks dp2 pp2 cp2 tp2" + (" (rec.)" if recorded16 else ""): (runs16, [runs16[r] for r in tracked16])}
    lines = [f"{'layout':>33} | {'model states':>12} {'peak':>9} (B per rank, max) | bytes sent per rank per step: "
             f"dp(×cp) pp cp tp"]
    states, peaks, sent = [], [], []
    for name, (rr, measured) in rows.items():
        states.append(max(r.model_state_bytes for r in rr))
        peaks.append(max(r.peak_bytes for r in measured))
        sent.append(mean_bytes(rr))
        lines.append(f"{name:>33} | {states[-1]:>12} {peaks[-1]:>9} | " + " ".join(f"{v:>7.0f}" for v in sent[-1].values()))
    lines.append(f"(16 ranks: peak measured on ranks {tracked16}, dp 0 and tp 0 of each stage and cp position; the "
                 f"other dp and tp ranks hold tensors of the same shapes)")
    act8, act16 = peaks[1] - states[1], peaks[2] - states[2]
    lines.append(f"what a step allocates (peak − model states): {act8} B at 8 ranks, {act16} B at 16: "
                 f"{act8 / act16:.2f}× less with cp = 2")
    return Report("\n".join(lines), _check_memory, states=states, peaks=peaks, sent=sent, act8=act8, act16=act16)


def _check_loss(r: Report) -> None:
    assert r.diffs["float64"] < 1e-13 and 1e-9 < r.diffs["float32"] < 1e-5


def loss_across_layouts(five: dict) -> Report:
    """§2.5: the same steps in float64 and float32, one device (trained now) against 16 ranks (max relative
    |Δloss|, in ε)."""
    diffs, lines = {}, []
    who = "16 ranks (rec.)" if "recorded" in five else "16 ranks"
    for name, rec, ranks in (("float64", five["recipe64"], five["runs64"]), ("float32", five["recipe32"], five["runs32"])):
        ref = train_reference(rec)
        losses = next(r.losses for r in ranks if r.losses is not None)
        diffs[name] = max(abs(a - b) / abs(a) for a, b in zip(ref.losses, losses))
        lines.append(f"{name}: {'one device':<17}{[f'{v:.10f}' for v in ref.losses]}\n         {who:<17}"
                     f"{[f'{v:.10f}' for v in losses]}   max relative |Δloss| = {diffs[name]:.1e}")
    eps = {"float64": torch.finfo(torch.float64).eps, "float32": torch.finfo(torch.float32).eps}
    lines.append("in units of each type's ε: " + ", ".join(f"{k} {v / eps[k]:.1f} ε (ε = {eps[k]:.1e})"
                                                          for k, v in diffs.items()))
    return Report("\n".join(lines), _check_loss, diffs=diffs)


def _check_moe_groups(r: Report) -> None:
    r.comparison.assert_ok()
    for rank, o in enumerate(r.moe):
        seen = o["groups"]
        for kind in ("dense", "ep", "expert_dp"):       # the running trainer's groups = expert_groups' (§2)
            assert rank in seen[kind][0] and seen[kind][0] in r.g16[kind] and seen[kind][1] == sum(seen[kind][0])
        j = seen["ep"][0].index(rank)                   # place in the ep group → experts j·E/ep … (j+1)·E/ep − 1
        assert o["experts_held"] == [2 * j, 2 * j + 1]
    assert r.copies == r.moe[0]["groups"]["expert_dp"][0]
    assert len(r.copies) == r.layout.dp * r.layout.cp * r.layout.tp // r.layout.ep


def moe_groups(five: dict, mesh: Mesh, g16: dict, layout) -> Report:
    """§2.6: the MoE run against one device, and each rank's dense, ep and expert-DP groups (asked of its own
    trainer) and the experts it holds."""
    moe, rec = five["moe"], five["moe_recipe"]
    comparison = five.get("moe_comparison") or compare(train_reference(rec), [o["run"] for o in moe], dtype=torch.float64)
    lines = [f"{rec.name} on {layout}: vs one device{' (recorded)' if 'recorded' in five else ''} {comparison}",
             f"{'rank':>4} {'coords':>15} | {'dense (dp×cp)':>14} {'ep':>8} {'expert-DP':>9} | experts held"]
    for rank, o in enumerate(moe):
        seen = o["groups"]
        lines.append(f"{rank:>4} {_coords(mesh, rank):>15} | {str(seen['dense'][0]):>14} {str(seen['ep'][0]):>8} "
                     f"{str(seen['expert_dp'][0]):>9} | {o['experts_held']}")
    stage0 = [r for r in range(mesh.world_size) if mesh.coords(r)["pp"] == 0]
    copies = [r for r in stage0 if 0 in moe[r]["experts_held"]]
    lines.append(f"ranks holding expert 0 of a stage-0 block: {copies} (= rank 0's expert-DP group, dp · cp · tp / ep "
                 f"of them)")
    return Report("\n".join(lines), _check_moe_groups, comparison=comparison, moe=moe, g16=g16, copies=copies,
                  layout=layout)


MOE_KINDS = ("dp", "pp", "cp", "tp", "ep", "edp", "balance")
OVER = {"dp": "dp × cp", "pp": "pp", "cp": "cp", "tp": "tp", "ep": "ep", "edp": "expert-DP", "balance": "dp×cp×tp"}
WINDOWS = {"dp": ("dp", "edp"), "pp+tp": ("pp", "cp", "tp", "ep", "balance")}


def _check_moe_bytes(r: Report) -> None:
    for run, f in zip(r.runs, r.formulas):                        # every rank, every kind: log = formula
        assert set(run.bytes_by_kind) == set(f) and all(abs(run.bytes_by_kind[k] - f[k]) < 1e-6 for k in f)
    for w, ks in WINDOWS.items():
        assert r.seen[w] >= sum(r.log[k] for k in ks)
    log, dense = r.log, r.dense
    assert log["pp"] == dense["pp"] and log["cp"] == dense["cp"]   # same activations, same K/V
    assert r.calls["ep"] == r.calls["cp"]                          # an all-to-all for every ring step
    assert log["tp"] < dense["tp"] and log["dp"] < dense["dp"] < log["edp"] == max(log.values())


def moe_bytes(five: dict, layout) -> Report:
    """§2.6: bytes per rank per step by kind (mean over ranks) from the group-tagged log, beside
    ``bytes_formula(..., moe=)``, and §2.1's dense run on the same mesh; observed per window."""
    runs, rec = [o["run"] for o in five["moe"]], five["moe_recipe"]
    model = rec.model()
    B, s = rec.batches[0][0].shape
    formulas = [bytes_formula(model.cfg, batch=B, seq=s, layout=layout, pp_rank=r.coords["pp"], moe=model.moe)
                for r in runs]
    n = len(runs)
    log = {k: sum(r.bytes_by_kind[k] for r in runs) / n for k in MOE_KINDS}
    want = {k: sum(f[k] for f in formulas) / n for k in MOE_KINDS}
    calls = {k: sum(r.calls_by_kind[k] for r in runs) / n for k in MOE_KINDS}
    dense = mean_bytes(five["runs64"])
    lines = [f"{'kind':>8} {'group':>10} | {'calls':>5} {'MoE log':>9} {'formula':>9} | {'dense run':>9}"]
    lines += [f"{k:>8} {OVER[k]:>10} | {calls[k]:5.1f} {log[k]:9.0f} {want[k]:9.0f} | {dense.get(k, 0):9.0f}"
              for k in MOE_KINDS]
    seen = {w: sum(r.observed[w] for r in runs) / n for w in WINDOWS}
    lines += [f"observed on the wire, {w} window: {seen[w]:.0f} B per rank per step (model "
              f"{sum(log[k] for k in ks):.0f} B)" for w, ks in WINDOWS.items()]
    return Report("\n".join(lines), _check_moe_bytes, runs=runs, formulas=formulas, log=log, calls=calls,
                  dense=dense, seen=seen)


def _check_moe_memory(r: Report) -> None:
    for o in r.moe:    # states = parameters + gradients + two Adam moments (+ Adam's step counters, a few bytes)
        assert 0 <= o["run"].model_state_bytes - 4 * o["param_bytes"]["all"] < 1e-3 * o["run"].model_state_bytes
    assert r.dense_states < r.moe_states < 4 * r.one_device_params and min(r.share) > 0.5
    assert r.edp_bytes == 1.5 * r.expert_params    # a ring over expert-DP = 4 sends 2(4−1)/4 = 1.5× the gradients


def moe_memory(five: dict) -> Report:
    """§2.6: model states per rank, dense against MoE on 16 ranks, the experts' share of a rank's parameters,
    and what ep = 2 saves against every rank holding all experts."""
    moe = five["moe"]
    moe_states = max(o["run"].model_state_bytes for o in moe)
    dense_states = max(r.model_state_bytes for r in five["runs64"])
    share = [o["param_bytes"]["experts"] / o["param_bytes"]["all"] for o in moe]
    one_device_params = tensor_bytes(list(five["moe_recipe"].model().double().parameters()))
    expert_params = max(o["param_bytes"]["experts"] for o in moe)
    edp_bytes = sum(o["run"].bytes_by_kind["edp"] for o in moe) / len(moe)
    lines = [f"dense GPT, 16 ranks: model states {dense_states} B per rank (max)",
             f"MoE GPT,   16 ranks: model states {moe_states} B per rank (max); experts {min(share):.0%}–{max(share):.0%} "
             f"of a rank's parameters ({expert_params} B of parameters)",
             f"MoE GPT, one device: {4 * one_device_params} B of parameters + gradients + Adam moments",
             f"with ep = 1 (every rank all 4 experts; counted: the experts' states twice) a rank would hold "
             f"{moe_states + 4 * expert_params} B: ep = 2 saves {4 * expert_params} B per rank"]
    return Report("\n".join(lines), _check_moe_memory, moe=moe, moe_states=moe_states, dense_states=dense_states,
                  share=share, one_device_params=one_device_params, expert_params=expert_params, edp_bytes=edp_bytes)

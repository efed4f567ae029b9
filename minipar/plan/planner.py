"""A planner: every layout of a model on a cluster, costed by :func:`minipar.plan.estimate`, the best few
that fit kept, and for every family that lost, the reason.

The search space is small on purpose (the idea of FlexFlow's and Alpa's searches, not their scale): tensor
parallel degrees that divide the heads, pipeline degrees that divide the layers, data parallelism for the
rest of the devices (it must divide the global batch), ZeRO 0-3 (2 and 3 only without a pipeline),
sequence parallelism on or off, the three recomputation modes, micro-batch sizes, and for pipelines the
1F1B and interleaved (v = 2) schedules. Each layout is one call of the cost model.

A family (:func:`minipar.plan.rules.family`: 'DDP', 'ZeRO-3', 'ZeRO-1 + TP + PP', ...) is rejected
because none of its layouts fits in memory, or because its best one is slower than the winner — and then
the reason names the term that costs it most (the bubble, TP across nodes, data-parallel traffic, ...).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cost import Cluster, Layout, estimate
from .model import Transformer
from .published import ranking_error
from .rules import family

__all__ = ["Plan", "plan", "pick", "layouts"]

_TERM_NAMES = {"bubble": "pipeline bubble", "tp": "tensor-parallel all-reduces", "dp": "data-parallel traffic",
               "pp": "pipeline sends", "cp": "context-parallel attention exchange", "ep": "expert all-to-alls",
               "compute": "compute (recomputation)", "optimizer": "optimizer step"}


@dataclass
class Plan:
    """``best``: the layouts that fit, each an :class:`~minipar.plan.cost.Estimate`, the pick first (:func:`plan`),
    then the fastest others; ``rejected``: {family: reason}; ``considered``: how many layouts were costed;
    ``families``: each family's fastest layout (its smallest if none fits); ``picks``: each fitting family's
    layout by the pick's rule — the least memory within the tie band of the fastest of all, else the family's
    fastest — so that families compare like with like."""
    best: list
    rejected: dict
    considered: int
    feasible: int = 0
    families: dict = field(default_factory=dict)      # {family: its best Estimate (fitting if any)}
    fastest: object = None                            # the fastest layout that fits (best[0] may hold less memory)
    tie: float = 0.0                                  # the tie band plan() used
    picks: dict = field(default_factory=dict)         # {family: its layout by the pick's rule (fitting only)}

    def pick_among(self, in_family):
        """The layout :func:`pick` takes among the families ``in_family(name)`` accepts (from :attr:`picks`)."""
        return pick([e for fam, e in self.picks.items() if in_family(fam)], self.fastest.step_seconds, self.tie)

    def __str__(self) -> str:
        lines = [f"{self.considered} layouts costed, {self.feasible} fit; best:"]
        lines += [f"  {i + 1}. {e}" for i, e in enumerate(self.best)]
        lines += ["rejected families:"] + [f"  {k}: {v}" for k, v in self.rejected.items()]
        return "\n".join(lines)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: Transformer, cluster: Cluster, global_batch: int, *, micro_batches_max: int = 4096,
            micro_batch_sizes=(1, 2, 4, 8), recompute=("none", "selective", "full"), zero=(0, 1, 2, 3),
            schedules=("1f1b", "interleaved"), use_all_devices: bool = True, cp=(1,), cp_methods=("ring",),
            ep=(1,)):
    """Every layout of the search space (a generator). ``cp``: the context-parallel degrees to try (those
    that divide the sequence), each with every method of ``cp_methods`` (chapter 06b: "ring",
    "ring-zigzag", "ulysses", "rsa"; those the model allows). ``ep``: expert-parallel degrees for an
    :class:`~minipar.plan.model.MoETransformer` (those dividing its experts and dp·cp: ep borrows data-
    and context-parallel ranks)."""
    n = cluster.devices
    sizes = [n] if use_all_devices else _divisors(n)
    for devices in sizes:
        for tp, c in [(t, c) for t in _divisors(model.heads) for c in cp
                      if devices % (t * c) == 0 and model.seq_len % c == 0]:
            for pp in [p for p in _divisors(model.layers) if devices % (tp * c * p) == 0]:
                dp = devices // (tp * c * pp)
                if global_batch % dp:
                    continue
                for b in micro_batch_sizes:
                    if (global_batch // dp) % b:
                        continue
                    m = global_batch // dp // b
                    if m > micro_batches_max:
                        continue
                    scheds = [("1f1b", 1)] if pp == 1 else [(s, 2 if s == "interleaved" else 1) for s in schedules]
                    for sched, v in scheds:
                        if pp > 1 and (m < pp or (sched == "interleaved" and (m % pp or model.layers % (pp * v)))):
                            continue
                        for z in zero:
                            if z >= 2 and pp > 1:
                                continue        # PP accumulates gradients, ZeRO-2/3 shard them (*总结* §8.3)
                            if z and dp * c == 1:
                                continue
                            for sp in ([False, True] if tp > 1 and model.seq_len % (c * tp) == 0 else [False]):
                                for r, method, e in _variants(model, tp, c, dp, recompute, cp_methods, ep):
                                    yield Layout(dp=dp, tp=tp, pp=pp, cp=c, v=v, zero=z, sp=sp, recompute=r,
                                                 micro_batch=b, micro_batches=m, schedule=sched, cp_method=method,
                                                 ep=e)


def _variants(model, tp, cp, dp, recompute, cp_methods, ep):
    """(recompute, cp method, ep) triples a layout of these degrees can take."""
    methods = [x for x in cp_methods if cp > 1 and (x != "ulysses" or (model.heads // tp) % cp == 0)
               and (x != "ring-zigzag" or model.seq_len % (2 * cp) == 0)] if cp > 1 else ["ring"]
    experts = getattr(model, "experts", None)
    eps = [e for e in ep if e == 1 or (experts and experts % e == 0 and (dp * cp) % e == 0)]
    return [(r, x, e) for r in recompute for x in methods for e in eps]


def _why_slower(e, winner, fastest, tie) -> str:
    if e.step_seconds <= max(1.005, 1 + tie) * fastest.step_seconds:
        return (f"as fast as the best (within the {max(tie, 0.005):.1%} the model cannot rank), but needs "
                f"{e.memory['total'] / 1e9:.1f} GB per device against {winner.memory['total'] / 1e9:.1f} GB ({e.layout})")
    extra = {k: v - winner.time.get(k, 0) for k, v in e.time.items() if k != "total"}
    term = max(extra, key=extra.get)
    name = _TERM_NAMES[term]
    if term == "tp" and "across nodes" in e.notes:
        name = "TP across nodes"
    return (f"fits, but {e.step_seconds / winner.step_seconds:.2f}× slower than the best "
            f"({e.step_seconds:.3g} s vs {winner.step_seconds:.3g} s): {name} "
            f"{e.time[term]:.3g} s ({e.layout})")


def pick(estimates: list, fastest_seconds: float, tie: float):
    """The pick's rule: of ``estimates``, those within the tie band (step ≤ (1 + ``tie``) × ``fastest_seconds``)
    give the one with the least memory per device, since the model cannot rank them; if none is inside the band,
    the fastest."""
    band = [e for e in estimates if e.step_seconds <= (1 + tie) * fastest_seconds]
    if band:
        return min(band, key=lambda e: (e.memory["total"], e.step_seconds))
    return min(estimates, key=lambda e: (e.step_seconds, e.memory["total"]))


def plan(model: Transformer, cluster: Cluster, global_batch: int, *, top: int = 3, precision="mixed",
         overlap=False, tie=None, **search) -> Plan:
    """The best of the layouts of ``model`` on all of ``cluster`` that fit in memory, then the ``top`` − 1 fastest
    others, and why each other family lost. ``search`` narrows the space (see :func:`layouts`); ``overlap``: as
    in :func:`minipar.plan.estimate`.

    The best is not always the fastest: among the layouts within ``tie`` of the fastest step (step ≤ (1 + tie) ×
    the fastest), it is the one with the least memory per device, since the model cannot rank layouts that
    close. ``tie`` defaults to :func:`minipar.plan.published.ranking_error`, the widest spread of the model's
    error over one published source's runs (10 %); ``tie=0`` picks the fastest. ``Plan.fastest`` is the
    fastest."""
    if global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    fitting, best_any, families, names = [], {}, {}, {}
    considered = 0
    for layout in layouts(model, cluster, global_batch, **search):
        e = estimate(model, cluster, layout, precision=precision, overlap=overlap)
        considered += 1
        fam = family(layout)
        if layout.tp > cluster.devices_per_node:
            fam += " (TP across nodes)"
            e.notes.append("across nodes")
        if fam not in best_any or e.memory["total"] < best_any[fam].memory["total"]:
            best_any[fam] = e
        names[id(e)] = fam
        if e.fits:
            fitting.append(e)
            if fam not in families or e.step_seconds < families[fam].step_seconds:
                families[fam] = e
    if considered == 0:
        raise ValueError(f"no layout of {cluster.devices} devices divides the global batch {global_batch} "
                         f"and the model's {model.layers} layers / {model.heads} heads")
    if tie is None:
        tie = ranking_error()
    fitting.sort(key=lambda e: (round(e.step_seconds, 9), e.memory["total"]))   # equal steps: less memory
    fastest = fitting[0] if fitting else None
    by_family = {}
    for e in fitting:
        by_family.setdefault(names[id(e)], []).append(e)
    picks = {fam: pick(es, fastest.step_seconds, tie) for fam, es in by_family.items()}
    if fitting:                  # the pick first, then the fastest others
        chosen = pick(fitting, fastest.step_seconds, tie)
        fitting.remove(chosen)
        fitting.insert(0, chosen)
    best = fitting[:top]
    rejected = {}
    winner = best[0] if best else None
    for fam, e in best_any.items():
        if fam in families:
            if fam != names[id(winner)]:
                rejected[fam] = _why_slower(families[fam], winner, fastest, tie)
        else:
            rejected[fam] = (f"does not fit: its smallest layout needs {e.memory['total'] / 1e9:.1f} GB per device "
                             f"> {cluster.memory_bytes / 1e9:.0f} GB ({e.layout})")
    return Plan(best, rejected, considered, len(fitting), {**best_any, **families}, fastest, tie, picks)



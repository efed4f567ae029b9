"""Chapter 09 measurements and pictures, from real runs of :mod:`minipar.moe`.

* :func:`balance_run` — train the MoE tiny GPT on one process and record, every step, the tokens each expert
  was sent (first choices) and the tokens dropped; with and without the load-balancing loss (routers drawn
  with a large std, so that routing starts confident and unequal).
* :func:`drop_fraction` — the fraction of token-choices dropped at each capacity factor, for a router.
* :func:`all_to_all_bytes` — EP on 4 ranks, one training step per (k, cf): bytes of the all-to-alls per
  rank per MoE layer, observed on the wire beside the log's model and 2·k·cf·T·M·b per direction.
* :func:`flops_per_token` — forward FLOPs per token (``torch.utils.flop_counter``) of the MoE GPT and of a
  dense GPT with as many parameters.

Figures: ``09_routing.png`` (a routing drawn: slots, capacity, dropped tokens), ``09_balance.png`` (the
busiest expert's load over training with and without the balancing loss), ``09_capacity.png`` (dropped
fraction vs capacity factor), ``09_loss_free.png`` (the busiest expert's load and the LM loss: no balancing, the
Switch loss, loss-free balancing).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from minipar.check import one_thread, train_steps
from minipar.moe.layer import MoEConfig, MoEGPT, moe_recipe
from minipar.moe.router import route

__all__ = ["balance_run", "busiest_share", "expert_loads", "lm_losses", "drop_fraction", "all_to_all_bytes",
           "flops_per_token", "LOSS_FREE_RATE", "draw_lm_loss", "draw_routing", "draw_balance", "draw_capacity", "FIGURES"]


def _skewed_routers(model, std: float, seed: int = 1) -> None:
    """Re-draw every router's weights with a large std: confident, unequal routing from the first step
    (a router at GPT-2's std 0.02 starts almost uniform and takes many more steps to drift)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.weight.normal_(0.0, std, generator=g)


def balance_run(alpha: float, steps: int = 60, router_std: float = 1.0, experts: int = 4,
                capacity_factor: float = 1.25, seed: int = 0, bias_rate: float = 0.0, lr: float | None = None) -> dict:
    """Train the MoE GPT (top-1) for ``steps`` Adam steps on one process. Returns per step: ``loss`` (LM +
    aux), ``aux``, ``wanted`` [layer][expert] first-choice tokens, ``dropped`` fraction; ``tokens`` per
    layer, ``experts``; ``logits``: the first MoE layer's router logits (T, E) in the last step.
    ``bias_rate`` γ > 0: loss-free balancing, the routing biases updated after every step (``bias``: their
    values at the end, per layer)."""
    with one_thread():
        recipe = moe_recipe(steps=steps, batch_size=8, seq_len=16, experts=experts, k=1,
                            capacity_factor=capacity_factor, alpha=alpha, seed=seed)
        model = recipe.model()
        if bias_rate:
            model = MoEGPT(model.cfg, replace(model.moe, bias_rate=bias_rate), seed)
        _skewed_routers(model, router_std)
        opt = recipe.optimizer(model.parameters()) if lr is None else torch.optim.Adam(model.parameters(), lr=lr)
        out = {"aux": [], "wanted": [], "dropped": [], "tokens": 0, "experts": experts}
        first = model.moe_layers()[0].router
        first.register_forward_hook(lambda m, i, o: out.__setitem__("logits", o.detach()))

        def after_step(model):                         # the routing bias moved, this step's routing kept
            model.update_routing_bias()
            routings = [layer.routing for layer in model.moe_layers()]
            out["tokens"] = routings[0].probs.shape[0]
            out["aux"].append(model.aux_loss().item())
            out["wanted"].append([r.wanted().tolist() for r in routings])
            out["dropped"].append(sum(r.dropped for r in routings) / (len(routings) * out["tokens"]))
        out["loss"] = train_steps(recipe, model, opt, recipe.batches, after_step).losses
        out["bias"] = [getattr(layer, "routing_bias", torch.zeros(experts)).tolist() for layer in model.moe_layers()]
        return out


def lm_losses(run: dict) -> list:
    """Per step: the language-model loss alone (the total minus the balancing terms)."""
    return [total - aux for total, aux in zip(run["loss"], run["aux"])]


def expert_loads(run: dict, last: int = 20) -> torch.Tensor:
    """(layers, E): the tokens each expert was sent, summed over the run's ``last`` steps (EPLB's input)."""
    return torch.tensor(run["wanted"][-last:]).sum(dim=0)


def busiest_share(run: dict) -> list:
    """Per step: max over layers and experts of (tokens sent to the expert) / (fair share T/E)."""
    e = len(run["wanted"][0][0])
    return [max(max(w) for w in step) * e / run["tokens"] for step in run["wanted"]]


def drop_fraction(logits: torch.Tensor, factors, k: int = 1) -> list:
    """Fraction of the T·k token-choices dropped at each capacity factor."""
    return [route(logits, k, cf).dropped / logits.numel() * logits.shape[1] / k for cf in factors]


def _bytes_rank(rank, world_size, settings, ep):
    from minipar import comm
    from minipar.moe import expert_parallel as epm
    rows = []
    for k, cf in settings:
        recipe = moe_recipe(steps=1, batch_size=8, seq_len=16, experts=4, k=k, capacity_factor=cf)
        step_log = comm.CommLog()
        epm.parallel_train(rank, world_size, recipe, ep=ep, step_log=step_log)
        log = step_log.select(op="all_to_all", dims=("ep",))
        layers = len(recipe.model().moe_layers())
        rows.append((k, cf, log.bytes_sent / layers, (log.observed_bytes_sent or 0) / layers,
                     log.count("all_to_all") // layers))
    return rows


def all_to_all_bytes(settings=((1, 1.0), (1, 1.25), (1, 2.0), (2, 1.25)), world_size: int = 4, ep: int = 4):
    """[(k, cf, modelled, observed, formula, calls)] per rank (mean over ranks), per MoE layer, per step.
    ``formula`` = both directions: 2 × 2·k·cf·T·M·b, T = tokens per rank."""
    from minipar.launcher import launch
    from minipar.moe.expert_parallel import predicted_all_to_all_bytes
    out = launch(_bytes_rank, world_size, list(settings), ep, quiet=True)
    cfg = moe_recipe(steps=1).model().cfg
    tokens = 8 // world_size * 16
    rows = []
    for i, (k, cf) in enumerate(settings):
        per = [o[i] for o in out]
        model = sum(p[2] for p in per) / len(per)
        seen = sum(p[3] for p in per) / len(per)
        pred = predicted_all_to_all_bytes(tokens, cfg.n_embd, MoEConfig(4, k, cf), ep)
        rows.append((k, cf, model, seen, 2 * pred["formula"], per[0][4], pred["capacity"]))
    return rows


def flops_per_token(experts: int = 4, k: int = 1, capacity_factor: float = 1.0, tokens: int = 8 * 16,
                    **moe_changes) -> dict:
    """Forward FLOPs per token and parameters: the MoE GPT, and a dense GPT whose FFN hidden size is E
    times larger (about the same parameters). Counted by ``torch.utils.flop_counter`` (matmuls).
    ``moe_changes``: other :class:`~minipar.moe.layer.MoEConfig` fields (``shared``, ``granularity``)."""
    from torch.utils.flop_counter import FlopCounterMode
    from minipar.models import GPTConfig, TinyGPT
    cfg = GPTConfig()
    moe_model = MoEGPT(cfg, MoEConfig(experts, k, capacity_factor, **moe_changes))
    dense = TinyGPT(cfg.with_(ffn_mult=cfg.ffn_mult * experts))
    base = TinyGPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (tokens // 16, 16), generator=torch.Generator().manual_seed(0))
    result = {}
    for name, model in (("moe", moe_model), ("dense same params", dense), ("dense same compute", base)):
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(idx)
        result[name] = (counter.get_total_flops() / tokens, sum(p.numel() for p in model.parameters()))
    return result


# ---- drawings --------------------------------------------------------------------------------------------

def draw_routing(routing, ax=None):
    """Tokens (columns) → experts (rows): a filled cell per kept choice, numbered by slot; ✗ where dropped;
    a dashed line at the capacity."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(8, 2.8))[1]
    t, e = routing.probs.shape
    colors = plt.get_cmap("tab10")
    for tok in range(t):
        for j in range(routing.expert.shape[1]):
            ex, slot, kept = int(routing.expert[tok, j]), int(routing.slot[tok, j]), bool(routing.kept[tok, j])
            ax.add_patch(plt.Rectangle((tok - 0.45, ex - 0.4), 0.9, 0.8, color=colors(ex),
                                       alpha=0.85 if kept else 0.15))
            ax.text(tok, ex, str(slot) if kept else "✗", ha="center", va="center", fontsize=9,
                    color="white" if kept else "black")
    ax.set_xlim(-0.6, t - 0.4)
    ax.set_ylim(e - 0.5, -0.5)
    ax.set_xticks(range(t))
    ax.set_yticks(range(e), [f"expert {i}" for i in range(e)])
    ax.set_xlabel("token (in order: earlier tokens get the slots first)")
    ax.set_title(f"top-{routing.expert.shape[1]} routing, capacity C = {routing.capacity} slots per expert: "
                 f"number = slot, ✗ = dropped ({routing.dropped})")
    return ax


def draw_balance(runs: dict, ax=None):
    """runs: {label: balance_run(...)}; the busiest expert's share of tokens (1 = balanced) over steps."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    for label, run in runs.items():
        ax.plot(busiest_share(run), label=f"{label}: busiest expert")
        ax.plot([4 * d for d in run["dropped"]], ls=":", color=ax.lines[-1].get_color(),
                label=f"{label}: 4 × dropped fraction")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel("tokens / fair share T/E")
    ax.set_ylim(top=5.2 if len(runs) > 2 else None)          # room above the curves for a two-column legend
    ax.legend(fontsize=7 if len(runs) > 2 else 8, ncol=2 if len(runs) > 2 else 1, loc="upper right")
    ax.set_title("load of the busiest expert (max over 2 MoE layers), top-1, 4 experts, cf 1.25")
    return ax


def draw_lm_loss(runs: dict, ax=None):
    """runs: {label: balance_run(...)}; the language-model loss alone (balancing terms removed) over steps."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    for label, run in runs.items():
        ax.plot(lm_losses(run), label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("LM loss (cross-entropy)")
    ax.legend(fontsize=8)
    ax.set_title("language-model loss, without the balancing terms")
    return ax


def draw_capacity(factors, curves: dict, ax=None,
                  title="dropped tokens vs capacity factor (top-1, 4 experts, T = 128)"):
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(6, 3))[1]
    for label, fracs in curves.items():
        ax.plot(factors, fracs, marker="o", label=label)
    ax.set_xlabel("capacity factor cf (C = ⌈T/E · cf⌉)")
    ax.set_ylabel("fraction of tokens dropped")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def example_routing():
    """The drawn example: 12 tokens, 4 experts, top-1, cf 1.0 (C = 3)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(12, 4, generator=g) + torch.tensor([1.0, 0.3, 0.0, -0.5])
    return route(logits, k=1, capacity_factor=1.0)


CAPACITY_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def _routing_png(path):
    import matplotlib.pyplot as plt
    ax = draw_routing(example_routing())
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)


LOSS_FREE_RATE = 0.01      # γ of the chapter's loss-free run (DeepSeek-V3: 0.001 at a far smaller learning rate)


@functools.lru_cache(maxsize=1)
def _balance_runs():
    return {"α = 0": balance_run(0.0), "α = 0.1": balance_run(0.1),
            f"loss-free γ = {LOSS_FREE_RATE}": balance_run(0.0, bias_rate=LOSS_FREE_RATE)}


def _loss_free_png(path):
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5))
    draw_balance(_balance_runs(), ax=top)
    draw_lm_loss(_balance_runs(), ax=bottom)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _balance_png(path):
    import matplotlib.pyplot as plt
    ax = draw_balance({k: v for k, v in _balance_runs().items() if k.startswith("α")})
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)


def _capacity_png(path):
    import matplotlib.pyplot as plt
    curves = {f"router trained with {label}": drop_fraction(run["logits"], CAPACITY_FACTORS)
              for label, run in _balance_runs().items() if label.startswith("α")}
    ax = draw_capacity(CAPACITY_FACTORS, curves,
                       title="dropped vs cf, 1st MoE layer after 60 steps (top-1, E = 4, T = 128)")
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)


FIGURES = {"09_routing.png": _routing_png, "09_balance.png": _balance_png, "09_capacity.png": _capacity_png,
           "09_loss_free.png": _loss_free_png}

"""What a GPT-style model costs, in closed form: parameters, activation bytes, FLOPs, model-state bytes.

Symbols (as in the papers): l layers, h hidden size, a attention heads, V vocabulary, s sequence length,
b micro-batch, B global batch, t tensor-parallel degree, f FFN hidden size (4h unless said otherwise).

* Parameters (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Eq. 2): ``P = 12 l h² (1 + 13/(12h) + (V + s)/(12 l h))`` — per layer 12h² weights and
  13h biases and LayerNorm parameters, plus the word and position embeddings (the output layer shares the
  word embedding; the final LayerNorm's 2h is left out).
* Activations kept for the backward, per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation
  in Large Transformer Models", §4 and Table 2), 16-bit values and 1-byte dropout masks::

      no parallelism                 sbh (34 + 5as/h)
      tensor parallel (TP)           sbh (10 + 24/t + 5as/(ht))
      TP + sequence parallel (SP)    sbh (34/t + 5as/(ht))
      TP + selective recompute       sbh (10 + 24/t)
      TP + SP + selective            sbh (34/t)
      full recompute                 2 sbh            (only the layer's input; 2sbh/t with SP)

  The formula lives in :mod:`minipar.activations` (chapters 06 and 11 measure against it); this module
  calls it.
* FLOPs per iteration (Korthikanti et al. 2022, Appendix A; Narayanan et al. 2021, Eq. 3): a forward is
  ``24 B s l h² (1 + s/(6h) + V/(16 l h))`` (matmuls only, multiply-add = 2); model FLOPs count forward +
  backward (3×): ``72 B s l h² (1 + s/(6h) + V/(12 l h))``. Hardware FLOPs add what recomputation
  repeats: full recompute one more forward of every layer, ``96 B s l h² (1 + s/(6h) + V/(16 l h))``;
  selective recompute ``72 B s l h² (1 + s/(3h) + V/(12 l h))`` (the paper's count, reproduced below from
  its Table 5).
* Model states per device: :func:`minipar.data.zero_memory.model_state_bytes_formula` (ZeRO, Rajbhandari et al.
  2020; arguments Ψ, dp, ZeRO stage, precision), re-exported here, not rewritten.

* Mixture of experts (:class:`MoETransformer`, chapter 09): an MoE block holds E expert MLPs and a router
  (parameters: the MLP × E + h·E; a rank of ep holds E/ep experts), computes k·cf slots per token (FLOPs:
  the MLP's × k·cf + 2·tokens·h·E) and keeps the MLP's activations for each slot (a model).

MFU (model FLOPs utilization) = model FLOPs / (seconds · devices · peak FLOP/s); HFU uses hardware FLOPs.
"""
from __future__ import annotations

from dataclasses import dataclass

from minipar.data.zero_memory import model_state_bytes_formula
from minipar.activations import MODES, activation_bytes_formula
from minipar.validation import positive_int

__all__ = ["Transformer", "MoETransformer", "expert_parameters", "parameters", "layer_parameters", "activation_bytes_per_layer", "forward_flops",
           "model_flops", "hardware_flops", "mfu", "hfu", "stage_layers", "model_state_bytes_formula", "GPT3_175B", "NARAYANAN_1T", "MODES"]


@dataclass(frozen=True)
class Transformer:
    """A GPT-style decoder: ``layers`` blocks of (LayerNorm, attention, LayerNorm, MLP) of width ``hidden``.

    ``ffn_hidden`` defaults to 4·hidden. ``tied_embeddings`` (the papers' models) shares the output layer
    with the word embedding; ``final_norm`` counts the last LayerNorm; ``max_positions`` is the size of
    the position table (``seq_len`` by default). :meth:`from_config` describes minipar's TinyGPT."""
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int | None = None
    tied_embeddings: bool = True
    final_norm: bool = False
    max_positions: int | None = None
    kv_heads: int | None = None
    gated_mlp: bool = False

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "vocab", "seq_len"):
            positive_int(f"Transformer.{name}", getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.kv_heads is not None and self.heads % positive_int("Transformer.kv_heads", self.kv_heads):
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")

    @property
    def qkv_width(self) -> float:
        """Output width of the QKV matmul: h(1 + 2·kv/a) — 3h, or less with grouped-query attention
        (``kv_heads`` < heads: Ainslie et al. 2023)."""
        return self.hidden * (1 + 2 * (self.kv_heads or self.heads) / self.heads)

    @property
    def mlp_matrices(self) -> int:
        """2 (h×f, f×h), or 3 for a gated MLP (SwiGLU: Shazeer 2020; Llama)."""
        return 3 if self.gated_mlp else 2

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def positions(self) -> int:
        return self.max_positions or self.seq_len

    @classmethod
    def from_config(cls, cfg, seq_len: int) -> "Transformer":
        """The description of ``minipar.models.TinyGPT(cfg)`` trained on sequences of ``seq_len``."""
        return cls(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, seq_len, cfg.ffn_hidden,
                   tied_embeddings=cfg.tie_weights, final_norm=True, max_positions=cfg.block_size)


@dataclass(frozen=True)
class MoETransformer(Transformer):
    """The same decoder with the MLP of every ``every``-th block replaced by a mixture of experts
    (:mod:`minipar.moe`, chapter 09; Switch Transformers, Fedus et al. 2021; GShard, Lepikhin et al. 2020):
    ``experts`` MLPs of the dense shape and a router (h × E, no bias); each token visits its top ``k``,
    each expert computes C = ⌈k·T/E·cf⌉ padded slots. So an MoE layer holds E× the MLP's parameters and
    computes k·cf× its FLOPs (+ the router's 2·T·h·E). The field names are :class:`minipar.moe.MoEConfig`'s,
    so this object can be passed where chapter 09's formulas take a config."""
    experts: int = 8
    k: int = 1
    capacity_factor: float = 1.0
    every: int = 1

    def __post_init__(self):
        super().__post_init__()
        for name in ("experts", "k", "every"):
            positive_int(f"MoETransformer.{name}", getattr(self, name))
        if self.k > self.experts:
            raise ValueError(f"top-k={self.k} must not exceed the {self.experts} experts")
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity factor must be > 0, got {self.capacity_factor}")

    @property
    def moe_share(self) -> float:
        """The fraction of blocks that are MoE blocks (1/every)."""
        return 1 / self.every

    @property
    def slots_per_token(self) -> float:
        """k·cf: the expert slots computed (and sent) per token."""
        return self.k * self.capacity_factor


GPT3_175B = Transformer(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048)
NARAYANAN_1T = Transformer(layers=128, hidden=25600, heads=160, vocab=51200, seq_len=2048)   # 2021, Table 1, last row


def _is_moe(model) -> bool:
    return isinstance(model, MoETransformer)


def expert_parameters(model: Transformer, tp: int = 1, ep: int = 1) -> float:
    """Expert parameters of one block (averaged over blocks: 1/every of them are MoE blocks) held by one rank:
    E/ep whole experts (expert-TP = 1; ep folded over a stage's dp × cp × tp ranks, as the hybrid trainer runs
    it, so ``tp`` does not split them). 0 for a dense model."""
    if not _is_moe(model):
        return 0.0
    h, f = model.hidden, model.ffn
    return model.moe_share * model.experts / ep * (h * f + f + f * h + h)


def layer_parameters(model: Transformer, tp: int = 1, ep: int = 1) -> float:
    """Parameters of one block held by one of ``tp`` tensor-parallel ranks: QKV and the first MLP matmul
    split by columns (weights and biases ÷ t), the projections by rows (weights ÷ t, biases whole), the two
    LayerNorms whole. With t = 1 and f = 4h: 12h² + 13h. A :class:`MoETransformer`'s MoE blocks hold
    E/ep experts (:func:`expert_parameters`) and the router (h·E, whole) instead of the MLP."""
    h, f, q = model.hidden, model.ffn, model.qkv_width
    attention = (q * h + q + h * h) / tp + h + 4 * h   # QKV, projection (its bias whole), LayerNorms
    dense_mlp = ((model.mlp_matrices - 1) * (h * f + f) + f * h) / tp + h
    if not _is_moe(model):
        return attention + dense_mlp
    share = model.moe_share
    return attention + (1 - share) * dense_mlp + share * h * model.experts + expert_parameters(model, tp, ep)


def parameters(model: Transformer) -> int:
    """Parameter count; for the papers' models (tied, no final norm) Narayanan et al. Eq. 2 exactly."""
    h = model.hidden
    embeddings = model.vocab * h + model.positions * h
    head = 0 if model.tied_embeddings else model.vocab * h
    final = 2 * h if model.final_norm else 0
    return int(model.layers * layer_parameters(model) + embeddings + head + final)


def activation_bytes_per_layer(model: Transformer, micro_batch: int, tp: int = 1, sp: bool = False,
                               recompute: str = "none", *, value_bytes: int = 2, dropout: bool = True,
                               seq_len: int | None = None) -> float:
    """Bytes one transformer layer keeps for the backward on one tensor-parallel rank (Korthikanti et al.
    2022, Table 2): 16-bit values and 1-byte dropout masks by default. ``seq_len`` overrides the model's
    (a context-parallel rank sees s/cp tokens). With f ≠ 4h the two MLP terms 4sbh become f/h·sbh each; with
    grouped-query attention K and V keep kv/a of their sbh each; a gated MLP keeps one more f-wide tensor (its
    gate's and its up-projection's outputs both feed the product)."""
    if tp < 1 or model.heads % tp:
        raise ValueError(f"tp must divide the number of heads ({model.heads}), got tp={tp}")
    s, b, h, a = seq_len or model.seq_len, micro_batch, model.hidden, model.heads
    if sp and tp == 1:
        sp = False                                        # nothing to shard the sequence across
    total = activation_bytes_formula(s, b, h, a, t=tp, sequence_parallel=sp, recompute=recompute,
                                     value_bytes=value_bytes, dropout=dropout)
    if recompute == "full":
        return total                                       # the layer's input, nothing else
    total += 2 * value_bytes * (model.ffn - 4 * h) * s * b / tp   # GeLU input and MLP-projection input
    total -= 2 * value_bytes * s * b * h * (1 - (model.kv_heads or a) / a) / tp   # GQA: smaller K and V
    total += value_bytes * s * b * model.ffn / tp if model.gated_mlp else 0       # SwiGLU: the gate's output too
    if _is_moe(model):       # k·cf slots per token: the MLP's inputs (h, f, f) again, and the (E, C, h)
        extra = model.slots_per_token - 1                  # dispatch and combine buffers (a model)
        total += model.moe_share * value_bytes * s * b * (extra * (h + 2 * model.ffn / tp)
                                                          + 2 * model.slots_per_token * h)
    return total


def forward_flops(model: Transformer, tokens: int) -> float:
    """Matmul FLOPs of one forward over ``tokens`` = B·s tokens: per layer 2·tokens·(4h² + 2hf) for the
    weights and 4·tokens·s·h for QKᵀ and the attention over V; the logits 2·tokens·h·V. An MoE block's MLP
    computes k·cf slots per token (padded to capacity, as :mod:`minipar.moe` runs it) and its router
    2·tokens·h·E."""
    h, s, f = model.hidden, model.seq_len, model.ffn
    mlp = 2 * tokens * model.mlp_matrices * h * f
    if _is_moe(model):
        mlp += model.moe_share * (mlp * (model.slots_per_token - 1) + 2 * tokens * h * model.experts)
    per_layer = 2 * tokens * (model.qkv_width + h) * h + mlp + 4 * tokens * s * h
    return model.layers * per_layer + 2 * tokens * h * model.vocab


def model_flops(model: Transformer, global_batch: int) -> float:
    """FLOPs the model needs per iteration (forward + backward = 3 forwards): with f = 4h,
    72 B s l h² (1 + s/(6h) + V/(12 l h))."""
    return 3 * forward_flops(model, global_batch * model.seq_len)


def hardware_flops(model: Transformer, global_batch: int, recompute: str = "none") -> float:
    """FLOPs the hardware does per iteration, recomputation included (Korthikanti et al. 2022, App. A).

    ``"full"``: one more forward of every layer (not of the logits): 96 B s l h² (1 + s/(6h) + V/(16lh)).
    ``"selective"``: the paper counts 72 B s l h² (1 + s/(3h) + V/(12lh)), i.e. 12·B·s²·h more per layer;
    its Table 5 HFU/MFU ratios are reproduced with this count (tests/test_plan_model.py). One forward of
    the attention core alone would be 4·B·s²·h per layer: the paper's count is an upper bound."""
    if recompute not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {recompute!r}")
    base = model_flops(model, global_batch)
    tokens, h, s, l = global_batch * model.seq_len, model.hidden, model.seq_len, model.layers
    if recompute == "full":
        return base + forward_flops(model, tokens) - 2 * tokens * h * model.vocab
    if recompute == "selective":
        return base + 12 * tokens * s * h * l
    return base


def stage_layers(layers: int, p: int, v: int = 1) -> tuple:
    """(first, middle, last): the layers a pipeline rank of ``p`` (``v`` chunks each) holds. Equal stages
    when p·v divides the layers; else, if p·v divides layers + 2, Llama 3's balanced cut (Dubey et al. 2024,
    §3.3.2: one layer fewer on the first and on the last stage, whose embedding and output layer with the
    loss each take a layer's place — 126 layers on 16 stages: 7, 8, 7). Any other count: ValueError."""
    if layers % (p * v) == 0:
        return (layers // p,) * 3
    if p > 1 and (layers + 2) % (p * v) == 0:
        most = (layers + 2) // p
        return most - 1, most, most - 1
    raise ValueError(f"{layers} layers cannot be cut into p·v = {p}·{v} = {p * v} equal stages (nor into "
                     f"Llama 3's balanced ones, the embedding and the output each in a layer's place: "
                     f"layers + 2 divisible by p·v)")


def mfu(model: Transformer, global_batch: int, seconds: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilization of an iteration that took ``seconds`` on ``devices`` of ``peak_flops``."""
    return model_flops(model, global_batch) / (seconds * devices * peak_flops)


def hfu(model: Transformer, global_batch: int, seconds: float, devices: int, peak_flops: float,
        recompute: str = "none") -> float:
    """Hardware FLOPs utilization: the same with the recomputed FLOPs counted."""
    return hardware_flops(model, global_batch, recompute) / (seconds * devices * peak_flops)

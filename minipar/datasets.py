"""Small datasets that need no download, deterministic from a seed.

* :func:`markov_tokens` — token ids from a random sparse bigram chain: there is structure to learn (each
  token has a few likely successors), so the loss visibly falls within a few dozen steps.
* :func:`char_corpus` — a short English text shipped with the package, encoded character by character.
* :func:`text_tokens` — a UTF-8 text file of the learner's own, as byte or character ids, and
  :func:`held_out` — its last tenth kept back for an evaluation loss.
* :func:`lm_batches` — (inputs, targets) windows for next-token prediction, the same for every rank.
* :func:`regression_batches` — (x, y) pairs for the MLP.
"""
from __future__ import annotations

import torch

__all__ = ["markov_tokens", "char_corpus", "CORPUS", "text_tokens", "held_out", "LEVELS", "lm_batches", "lm_batch",
           "regression_batches"]

LEVELS = ("byte", "char")

CORPUS = """\
A model too large for one device must be split. Data parallelism copies the model to every device and
splits the batch; the gradients are averaged so that every copy takes the same step. Pipeline parallelism
cuts the model into stages and passes activations from one device to the next, filling the pipe with
micro-batches so that fewer devices sit idle. Tensor parallelism splits a single matrix multiplication
across devices, by columns or by rows, and adds the collectives that put the pieces back together.
Sharded data parallelism keeps one copy of the optimizer state, the gradients and the parameters in pieces
across the devices and gathers each piece just before it is needed. Mixed precision halves the bytes of
every tensor and scales the loss so that small gradients do not vanish. Recomputation throws activations
away and computes them again in the backward pass. Every one of these trades memory, compute and
communication against each other, and every one of them must give the same answer as one device.
"""


def markov_tokens(n: int, vocab_size: int = 64, seed: int = 0, branching: int = 3) -> torch.Tensor:
    """``n`` token ids from a bigram chain where each token has ``branching`` possible successors."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab_size, (vocab_size, branching), generator=g)
    tok = int(torch.randint(vocab_size, (1,), generator=g))
    choices = torch.randint(branching, (n,), generator=g).tolist()
    successors, out = successors.tolist(), []
    for choice in choices:                   # Python lists: indexing a tensor per token cost 60 ms a call
        out.append(tok)
        tok = successors[tok][choice]
    return torch.tensor(out, dtype=torch.long)


def char_corpus() -> tuple:
    """(ids, vocabulary string) for :data:`CORPUS`, one id per character."""
    vocab = "".join(sorted(set(CORPUS)))
    index = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([index[ch] for ch in CORPUS], dtype=torch.long), vocab


def text_tokens(path: str, level: str = "byte") -> tuple:
    """(ids, vocabulary size) of the UTF-8 text in ``path``: ``"byte"``, one id per byte (256 ids, any
    script); ``"char"``, one id per distinct character, numbered in sorted order. ``ValueError`` for a file
    that cannot be read or is not UTF-8 (with the byte offset), or an unknown level."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if level == "byte":
        return torch.tensor(list(raw), dtype=torch.long), 256
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long), max(len(vocab), 1)


def held_out(tokens: torch.Tensor, fraction: float = 0.1) -> tuple:
    """(training, held-out) ids: the last ``fraction`` of the text is never trained on."""
    cut = len(tokens) - int(len(tokens) * fraction)
    return tokens[:cut], tokens[cut:]


def lm_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, step: int, seed: int = 0):
    """Global batch ``step``: ``batch_size`` random windows of ``seq_len`` tokens and their next tokens."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(len(tokens) - seq_len - 1, (batch_size,), generator=g)
    x = torch.stack([tokens[s: s + seq_len] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1: s + seq_len + 1] for s in starts.tolist()])
    return x, y


def lm_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, steps: int, seed: int = 0) -> list:
    """The first ``steps`` global batches (see :func:`lm_batch`)."""
    return [lm_batch(tokens, batch_size, seq_len, s, seed) for s in range(steps)]


def regression_batches(batch_size: int, d_in: int, d_out: int, steps: int, seed: int = 0) -> list:
    """``steps`` (x, y) batches with y a fixed smooth function of x plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, d_out, generator=g) / d_in ** 0.5
    batches = []
    for _ in range(steps):
        x = torch.randn(batch_size, d_in, generator=g)
        batches.append((x, torch.tanh(x @ w) + 0.01 * torch.randn(batch_size, d_out, generator=g)))
    return batches

"""Chapter 05: the library's own source of a TP layer, read live, with the branches this chapter does not teach
elided — sequence and context parallelism (chapters 06, 06b: a one-line pointer where SP branches off) and the
bitwise-reproducible mode (``invariant_active()``, ``canonical.*``: the same sums in a fixed tree order, for the
course's exactness tests; dropped without a marker, since no later chapter teaches it).

Each elision is an exact piece of the source and what replaces it (:data:`ELISIONS`). When a piece is no longer in
the library's source, :func:`teaching_source` raises ValueError instead of showing a stale or half-edited copy, so
the shown code cannot drift from the code that runs.
"""
from __future__ import annotations

import inspect

__all__ = ["ELISIONS", "teaching_source", "show"]

_SP = "# (sequence parallel: chapter 06)"

ELISIONS = {
    "ColumnParallelLinear.forward": [
        ("        if invariant_active():\n            return self.canonical_forward(x)\n", ""),
        ("        if self.sequence_parallel:   # x is a sequence shard: gather it inside the matmul (saves memory)\n"
         "            y = column_linear_sequence_parallel(x, self.weight, self.bias, self.group, "
         "self.keep_gathered_input)\n        else:\n            y = F.linear(", f"        {_SP}\n        y = F.linear("),
    ],
    "RowParallelLinear.forward": [
        ("        canonical_mode = invariant_active()    # the inner sum a tree: this rank's chunk of it a subtree\n"
         "        partial = canonical.linear(x, self.weight) if canonical_mode else F.linear(x, self.weight)\n",
         "        partial = F.linear(x, self.weight)\n"),
        ("        if self.sequence_parallel:             # no bias yet: t ranks would add it t times\n"
         "            y = scatter_sequence(partial, self.group)\n        else:\n            y = reduce_from_tp(",
         f"        {_SP}\n        y = reduce_from_tp("),
        ("        # SP: this rank's tokens are a chunk of each row, so the bias gradient's token sum needs the group\n"
         "        return canonical.AddBias.apply(y, self.bias, self.group if self.sequence_parallel else None) \\\n"
         "            if canonical_mode else y + self.bias\n", "        return y + self.bias\n"),
    ],
    "VocabParallelEmbedding.forward": [
        ("        lookup = canonical.embedding if invariant_active() else F.embedding   # invariant: Σ over tokens a tree\n"
         "        out = lookup(", "        out = F.embedding("),
        ("        if self.sequence_parallel:\n            return scatter_sequence(out, self.group)"
         "                     # sum, and keep my tokens\n", f"        {_SP}\n"),
    ],
    "_VocabParallelCrossEntropy.forward": [
        ("        total = canonical.tree_sum if invariant_active() else torch.sum   # invariant: this shard a subtree\n"
         "        sums = [total(exp_z, -1)] + ([total(z.masked_fill(~real, 0.0), -1)] if label_smoothing else [])\n",
         "        sums = [exp_z.sum(-1)] + ([z.masked_fill(~real, 0.0).sum(-1)] if label_smoothing else [])\n"),
        ("# 3. Σ exp (and Σ z); invariant: the tree finished\n", "# 3. Σ exp (and Σ z)\n"),
    ],
    "TensorParallelGPT.forward": [
        ("        \"\"\"``positions``: the global positions of the tokens the embedding returns (default: all of ``idx``'s,\n"
         "        or this rank's shard of them under SP); a context-parallel rank passes its own.\"\"\"\n", ""),
        ("x = self.embed(idx, positions)                 # whole sequence, or my shard under SP\n",
         "x = self.embed(idx, positions)                 # tokens + positions\n"),
        ("return self.head(self.final_norm(x))           # the head all-gathers the sequence under SP\n",
         "return self.head(self.final_norm(x))\n"),
    ],
    "TokenPositionEmbedding.embed": [
        ("        if invariant_active():     # the position table's gradient: a tree over the rows (and the SP ranks)\n"
         "            held = positions.expand(idx.shape[0], -1)\n"
         "            pos = canonical.embedding(held, self.pos_emb.weight, self.sequence_split_group())\n"
         "            return self.drop(self.tok_emb(idx) + pos)\n", ""),
    ],
}


def teaching_source(obj) -> str:
    """``obj``'s source (:func:`inspect.getsource`) with its :data:`ELISIONS` applied; unchanged for an object
    that has none. Raises ValueError naming the object when a piece to elide is missing from the source."""
    source = inspect.getsource(obj)
    name = obj.__qualname__
    for old, new in ELISIONS.get(name, []):
        if old not in source:
            raise ValueError(f"{name} no longer contains {old.strip()[:60]!r}…: update chapter 05's ELISIONS")
        source = source.replace(old, new, 1)
    return source


def show(obj):
    """``obj``'s source as the notebook displays it (Markdown): :func:`teaching_source`, its sequence-parallel
    and bitwise-reproducible branches elided."""
    from IPython.display import Markdown
    return Markdown(f"```python\n{teaching_source(obj)}\n```")

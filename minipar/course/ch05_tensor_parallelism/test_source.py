"""Chapter 05's shown source: the teaching path of the library's TP layers, and a loud failure on drift."""
import pytest

from minipar.course.ch05_tensor_parallelism.source import ELISIONS, teaching_source
from minipar.tensor import gpt, layers, vocab

SHOWN = [layers.ColumnParallelLinear.forward, layers.RowParallelLinear.forward, vocab.VocabParallelEmbedding.forward,
         vocab._VocabParallelCrossEntropy.forward, gpt.TokenPositionEmbedding.embed, gpt.TensorParallelGPT.forward]


def test_every_elision_applies_and_leaves_the_teaching_path():
    assert {f.__qualname__ for f in SHOWN} == set(ELISIONS)
    for f in SHOWN:
        text = teaching_source(f)
        compile("if True:\n" + text, f.__qualname__, "exec")          # still Python
        for untaught in ("invariant_active", "canonical", "self.sequence_parallel", "scatter_sequence",
                         "bitwise-reproducible", "context-parallel", "under SP"):
            assert untaught not in text, (f.__qualname__, untaught)
    assert "F.linear(copy_to_tp(x, self.group), self.weight, self.bias)" in teaching_source(SHOWN[0])
    assert "reduce_from_tp(partial, self.group)" in teaching_source(SHOWN[1])


def test_a_piece_missing_from_the_library_raises(monkeypatch):
    monkeypatch.setitem(ELISIONS, "ColumnParallelLinear.forward", [("no such line\n", "")])
    with pytest.raises(ValueError, match="ColumnParallelLinear.forward no longer contains"):
        teaching_source(layers.ColumnParallelLinear.forward)

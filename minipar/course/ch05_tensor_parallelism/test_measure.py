"""Chapter 05's memory per rank: measured from live tensors, equal to the formulas the chapter shows."""
from minipar.course.ch05_tensor_parallelism.measure import memory_per_degree, param_values_formula


def test_memory_per_rank_equals_the_formulas_and_tp_leaves_activations_whole():
    rows = {r["t"]: r for r in memory_per_degree(degrees=(1, 2, 4))}
    for r in rows.values():
        assert r["param_bytes"] == r["param_formula"] and r["activation_bytes"] == r["activation_formula"]
    assert param_values_formula(32, 1) == 12 * 32 * 32 + 13 * 32          # one device: 12h² + 13h
    assert rows[4]["param_bytes"] / rows[1]["param_bytes"] < 0.27          # the weights: almost 1/t
    assert 0.4 < rows[4]["activation_bytes"] / rows[1]["activation_bytes"] < 0.45   # activations: far from 1/t

"""The tiny GPT trained with context parallelism equals single-device training (loss at every step and every
parameter after real Adam steps, float64), for every method; bad shapes refused before any process starts."""
import pytest
import torch

from minipar.check import compare, gpt_recipe, train_reference
from minipar.sequence import context_parallel as cp


def recipe(**changes):
    r = gpt_recipe(steps=3, batch_size=2, seq_len=16, **changes)
    r.dtype = torch.float64
    return r


@pytest.mark.parametrize("method,n", [("ring", 4), ("ring-zigzag", 4), ("ring-zigzag", 2), ("ulysses", 4),
                                      ("rsa", 4)])
def test_context_parallel_gpt_equals_one_device(method, n):
    r = recipe()
    results = cp.run(r, world_size=n, method=method, quiet=True)
    comparison = compare(train_reference(r), results, dtype=torch.float64)
    comparison.assert_ok()


def test_refused_before_launch():
    with pytest.raises(ValueError, match="2N = 8"):
        cp.validate(gpt_recipe(seq_len=12), 4, "ring-zigzag")
    with pytest.raises(ValueError, match="n_head = 4 is not divisible by N = 3"):
        cp.validate(gpt_recipe(seq_len=12), 3, "ulysses")
    with pytest.raises(ValueError, match="divisible by 3"):
        cp.validate(gpt_recipe(seq_len=16), 3, "ring")
    with pytest.raises(ValueError, match="unknown context-parallel method"):
        cp.validate(recipe(), 4, "striped")
    with pytest.raises(ValueError, match="dropout"):
        cp.validate(recipe(dropout=0.1), 4, "ring")
    cp.validate(gpt_recipe(seq_len=12), 4, "ring")     # 12 = 4 · 3: contiguous is fine

"""Chapter 14 checks accept the right answers and reject the stub and plausible wrong ones: PowerSGD bytes
without the ring factor, compressing every matrix, counting only P, ignoring a 4-D tensor's trailing
dimensions; an outer step with the sign flipped, plain momentum, parameter averaging, or a sum."""
import math
import re

import pytest
import torch

from minipar.comm import predicted_bytes_sent
from minipar.course.checks import ExerciseError
from minipar.course.ch14_shrinking_communication import checks as ch14


def _bytes(shapes, r, n, b, *, ring=True, only_gain=True, flatten=True, both=True):
    total = 0
    for s in shapes:
        rows, cols = (s[0], math.prod(s[1:])) if flatten else (s[0], s[1] if len(s) > 1 else 1)
        gains = (rows + cols) * min(rows, cols, r) < rows * cols
        if len(s) >= 2 and (gains or not only_gain):
            total += ((rows + cols) if both else rows) * min(rows, cols, r)
        else:
            total += math.prod(s)
    return total * b * (predicted_bytes_sent("all_reduce", 1, n) if ring else 1)


def bytes_right(shapes, r, n, b):
    return _bytes(shapes, r, n, b)


def bytes_stub(shapes, r, n, b):
    raise NotImplementedError()


@pytest.mark.parametrize("wrong,mistake", [
    (dict(ring=False), "2(N−1)/N"),
    (dict(only_gain=False), "only when (n + m)·r < n·m"),
    (dict(flatten=False), "more than 2 dimensions"),
    (dict(both=False), "count both"),
])
def test_bytes_check_names_the_mistake(wrong, mistake):
    with pytest.raises(ExerciseError, match=re.escape(mistake)):
        ch14.check_powersgd_step_bytes(lambda *a: _bytes(*a, **wrong))


def test_bytes_check_passes_the_right_answer_and_refuses_the_stub(capsys):
    ch14.check_powersgd_step_bytes(bytes_right)
    assert "every case equals" in capsys.readouterr().out
    with pytest.raises(NotImplementedError):
        ch14.check_powersgd_step_bytes(bytes_stub)


def _outer(theta, replicas, buf, lr, momentum, *, sign=1, nesterov=True, average=False, mean=True):
    if average:
        return sum(replicas) / len(replicas), buf
    delta = sum(theta - t for t in replicas) / (len(replicas) if mean else 1) * sign
    buf = delta.clone() if buf is None else momentum * buf + delta
    return theta - lr * (delta + momentum * buf if nesterov else buf), buf


def outer_right(theta, replicas, buf, lr=0.7, momentum=0.9):
    return _outer(theta, replicas, buf, lr, momentum)


@pytest.mark.parametrize("wrong,mistake", [
    (dict(sign=-1), "moves against it"),
    (dict(nesterov=False), "Nesterov"),
    (dict(average=True), "not the replicas' average"),
    (dict(mean=False), "not the sum"),
])
def test_outer_check_names_the_mistake(wrong, mistake):
    with pytest.raises(ExerciseError, match=re.escape(mistake)):
        ch14.check_outer_step(lambda t, reps, buf, lr, m: _outer(t, reps, buf, lr, m, **wrong))


def test_outer_check_passes_the_right_answer_and_refuses_the_stub(capsys):
    ch14.check_outer_step(outer_right)
    assert "every round equals" in capsys.readouterr().out

    def stub(theta, replicas, buf, lr=0.7, momentum=0.9):
        raise NotImplementedError()
    with pytest.raises(NotImplementedError):
        ch14.check_outer_step(stub)


def test_the_outer_reference_is_diloco_s_rule():
    """The check's reference is the library's: DiLoCo's synchronise on one process group of one rank would
    need a launch; its rule is diloco_reference's `outer_optimizer` step, the same SGD(nesterov=True)."""
    from minipar.data.diloco import outer_optimizer
    theta = torch.randn(5, dtype=torch.float64)
    drift = [[0.1 * torch.randn(5, dtype=torch.float64) for _ in range(2)] for _ in range(3)]
    t = theta.clone()
    opt = outer_optimizer([t], 0.7, 0.9)
    for d in drift:
        t.grad = -sum(d) / len(d)
        opt.step()
    assert torch.allclose(t, ch14.outer_reference(theta, drift, 0.7, 0.9)[-1], atol=1e-14)

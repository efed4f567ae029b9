"""Chapter 06 checks: each accepts a right answer and rejects the unfinished stub (NotImplementedError) and
the plausible wrong answers kept here (g: gathered along the batch, an all-reduce instead of the
all-gather, no sum in backward, an average, an all-reduce instead of the reduce-scatter; the LayerNorm
gradients: not summed, averaged, one all-reduce per parameter, summed but not copied back, a None grad
touched; the bytes: TP's all-reduces at half price, SP without its re-gathers, re-gathers counted while the
inputs are kept). Tolerance of the checks: 1e-9 in float64."""
import pytest
import torch
import torch.distributed as dist

from minipar import comm
from minipar.course.checks import ExerciseError
from minipar.course.ch06_sequence_parallelism import checks as ch06


# ----------------------------------------------------------------------------------------------------
# 1. g (Korthikanti et al. 2022) as an autograd function
# ----------------------------------------------------------------------------------------------------

def _gather(x, dim, group, all_reduce=False):
    t, me = dist.get_world_size(group), dist.get_rank(group)
    if all_reduce:          # zero-pad the other ranks' places and sum: right values, 2x the bytes
        parts = [torch.zeros_like(x) for _ in range(t)]
        parts[me] = x
        return comm.all_reduce(torch.cat(parts, dim).contiguous(), group=group)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((t * x0.shape[0],) + x0.shape[1:])
    comm.all_gather_into_tensor(out, x0, group=group)
    return out.movedim(0, dim)


def _scatter(g, dim, group, all_reduce=False, average=False, no_sum=False):
    t, me = dist.get_world_size(group), dist.get_rank(group)
    if no_sum:
        return g.chunk(t, dim)[me].contiguous()
    if all_reduce:
        return comm.all_reduce(g.contiguous().clone(), group=group).chunk(t, dim)[me].contiguous()
    g0 = g.movedim(dim, 0).contiguous()
    out = g0.new_empty((g0.shape[0] // t,) + g0.shape[1:])
    comm.reduce_scatter_tensor(out, g0, group=group)
    out = out.movedim(0, dim)
    return out / t if average else out


def _gather_sequence(dim=1, stub=False, **wrong):
    fwd_wrong = {"all_reduce": wrong.pop("forward_all_reduce", False)}

    class GatherSequence(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x_shard, group):
            ctx.group = group
            if stub:
                raise NotImplementedError()
            return _gather(x_shard, dim, group, **fwd_wrong)

        @staticmethod
        def backward(ctx, grad):
            return _scatter(grad, dim, ctx.group, **wrong), None
    return GatherSequence


def test_gather_sequence_accepts_the_right_answer(capsys):
    ch06.check_gather_sequence(_gather_sequence())
    assert "one all-gather forward and one reduce-scatter backward" in capsys.readouterr().out


def test_gather_sequence_rejects_the_stub():
    with pytest.raises(NotImplementedError):
        ch06.check_gather_sequence(_gather_sequence(stub=True))


@pytest.mark.parametrize("wrong,message", [
    (dict(dim=0), "along the batch"),
    (dict(forward_all_reduce=True), "twice the bytes"),
    (dict(no_sum=True), "only your rank's own gradient"),
    (dict(average=True), "summed, not averaged"),
    (dict(all_reduce=True), "each rank needs only its own tokens"),
])
def test_gather_sequence_rejects(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ch06.check_gather_sequence(_gather_sequence(**wrong))


# ----------------------------------------------------------------------------------------------------
# 2. Summing the sequence-parallel gradients
# ----------------------------------------------------------------------------------------------------

def sync_right(params, group):
    grads = [p.grad for p in params if p.grad is not None]
    flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_stub(params, group):
    raise NotImplementedError()


def sync_nothing(params, group):
    pass


def sync_average(params, group):
    sync_right(params, group)
    for p in params:
        if p.grad is not None:
            p.grad /= dist.get_world_size(group)


def sync_each(params, group):
    for p in params:
        if p.grad is not None:
            comm.all_reduce(p.grad, group=group)


def sync_not_copied_back(params, group):
    comm.all_reduce(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]), group=group)


def sync_fills_none(params, group):
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    sync_right(params, group)


def test_sync_accepts_the_right_answer():
    ch06.check_sync_sp_grads(sync_right)


def test_sync_rejects_the_stub():
    with pytest.raises(NotImplementedError):
        ch06.check_sync_sp_grads(sync_stub)


@pytest.mark.parametrize("wrong,message", [
    (sync_nothing, "still this rank's partial gradient"),
    (sync_not_copied_back, "copy the summed values back"),
    (sync_average, "summed, not averaged"),
    (sync_each, "one all-reduce per parameter"),
    (sync_fills_none, "skip parameters whose grad is None"),
])
def test_sync_rejects(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ch06.check_sync_sp_grads(wrong)


# ----------------------------------------------------------------------------------------------------
# 3. The bytes of one layer
# ----------------------------------------------------------------------------------------------------

def bytes_right(b, s, h, t, sequence_parallel, regather=True):
    sbh = b * s * h * 4
    if not sequence_parallel:
        return 4 * 2 * (t - 1) / t * sbh
    return (8 + (2 if regather else 0)) * (t - 1) / t * sbh


def bytes_stub(b, s, h, t, sequence_parallel, regather=True):
    raise NotImplementedError()


def bytes_half_price_all_reduce(b, s, h, t, sequence_parallel, regather=True):
    return bytes_right(b, s, h, t, sequence_parallel, regather) / (1 if sequence_parallel else 2)


def bytes_no_regather(b, s, h, t, sequence_parallel, regather=True):
    return bytes_right(b, s, h, t, sequence_parallel, False)


def bytes_always_regather(b, s, h, t, sequence_parallel, regather=True):
    return bytes_right(b, s, h, t, sequence_parallel, True)


def bytes_sp_as_all_reduces(b, s, h, t, sequence_parallel, regather=True):   # AG and RS priced as all-reduces
    return 2 * bytes_right(b, s, h, t, sequence_parallel, regather) if sequence_parallel else bytes_right(b, s, h, t, False)


def test_layer_bytes_accepts_the_right_answer(capsys):
    ch06.check_layer_bytes(bytes_right)
    assert "TP+SP inputs kept" in capsys.readouterr().out


def test_layer_bytes_rejects_the_stub():
    with pytest.raises(NotImplementedError):
        ch06.check_layer_bytes(bytes_stub)


@pytest.mark.parametrize("wrong,message", [
    (bytes_half_price_all_reduce, "each 2\\(t-1\\)/t"),
    (bytes_no_regather, "re-gathers are missing"),
    (bytes_always_regather, "no re-gather: the same bytes as TP"),
    (bytes_sp_as_all_reduces, "half an all-reduce"),
])
def test_layer_bytes_rejects(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ch06.check_layer_bytes(wrong)

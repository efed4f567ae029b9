"""Chapter 03 checks: each accepts the right answer and rejects the stub and the plausible wrong ones here."""
import pytest
import torch
import torch.distributed as dist

from minipar import comm
from minipar.course.checks import ExerciseError
from minipar.course.ch03_zero_and_fsdp import checks as ch03
from minipar.optim.muon import newton_schulz


def zero1_right(full_params, local_grads, shard, optimizer):
    n = dist.get_world_size()
    summed = torch.empty_like(shard)
    comm.reduce_scatter_tensor(summed, local_grads)
    shard.grad = summed / n
    optimizer.step()
    comm.all_gather_into_tensor(full_params, shard.detach())


def zero1_stub(full_params, local_grads, shard, optimizer):
    raise NotImplementedError()


def zero1_no_mean(full_params, local_grads, shard, optimizer):
    summed = torch.empty_like(shard)
    comm.reduce_scatter_tensor(summed, local_grads)
    shard.grad = summed
    optimizer.step()
    comm.all_gather_into_tensor(full_params, shard.detach())


def zero1_no_gather(full_params, local_grads, shard, optimizer):
    n, r = dist.get_world_size(), dist.get_rank()
    summed = torch.empty_like(shard)
    comm.reduce_scatter_tensor(summed, local_grads)
    shard.grad = summed / n
    optimizer.step()
    full_params[r * shard.numel():(r + 1) * shard.numel()] = shard.detach()


def zero1_all_reduce(full_params, local_grads, shard, optimizer):
    n, r = dist.get_world_size(), dist.get_rank()
    comm.all_reduce(local_grads)
    shard.grad = local_grads[r * shard.numel():(r + 1) * shard.numel()] / n
    optimizer.step()
    comm.all_gather_into_tensor(full_params, shard.detach())


def zero1_ddp_around_the_log(full_params, local_grads, shard, optimizer):
    """ZeRO-1 written as DDP: a full all-reduce (2.25x ZeRO-1's traffic with the all-gather), called straight
    through torch.distributed so that minipar's log sees only the all-gather. The numbers are right."""
    n, r = dist.get_world_size(), dist.get_rank()
    dist.all_reduce(local_grads)
    shard.grad = local_grads[r * shard.numel():(r + 1) * shard.numel()] / n
    optimizer.step()
    comm.all_gather_into_tensor(full_params, shard.detach())


def zero1_ring(full_params, local_grads, shard, optimizer):
    """Right, on minipar's send/recv rings instead of gloo's collectives."""
    n = dist.get_world_size()
    shard.grad = comm.ring_reduce_scatter(local_grads.view(n, -1)).reshape(-1) / n
    optimizer.step()
    full_params.copy_(comm.ring_all_gather(shard.detach().clone()))


def zero1_local_grads(full_params, local_grads, shard, optimizer):
    r = dist.get_rank()
    shard.grad = local_grads[r * shard.numel():(r + 1) * shard.numel()].clone()
    optimizer.step()
    comm.all_gather_into_tensor(full_params, shard.detach())


def unit_right(weight_shard, out_features, in_features, x):
    n = dist.get_world_size()
    full = torch.empty(n * weight_shard.numel())
    comm.all_gather_into_tensor(full, weight_shard)
    w = full[: out_features * in_features].view(out_features, in_features)
    y = x @ w.t()
    del full, w
    return y


def unit_stub(weight_shard, out_features, in_features, x):
    raise NotImplementedError()


KEPT = []


def unit_keeps_weight(weight_shard, out_features, in_features, x):
    n = dist.get_world_size()
    full = torch.empty(n * weight_shard.numel())
    comm.all_gather_into_tensor(full, weight_shard)
    KEPT.append(full)                                   # "cache it for the backward"
    return x @ full[: out_features * in_features].view(out_features, in_features).t()


def unit_all_reduce(weight_shard, out_features, in_features, x):
    n, r = dist.get_world_size(), dist.get_rank()
    full = torch.zeros(n * weight_shard.numel())
    full[r * weight_shard.numel():(r + 1) * weight_shard.numel()] = weight_shard
    comm.all_reduce(full)
    return x @ full[: out_features * in_features].view(out_features, in_features).t()


def unit_all_reduce_around_the_log(weight_shard, out_features, in_features, x):
    """The weight rebuilt with an all-reduce of a zero-padded buffer, straight through torch.distributed:
    the log sees nothing at all (0 bytes, under any upper bound)."""
    n, r = dist.get_world_size(), dist.get_rank()
    full = torch.zeros(n * weight_shard.numel())
    full[r * weight_shard.numel():(r + 1) * weight_shard.numel()] = weight_shard
    dist.all_reduce(full)
    return x @ full[: out_features * in_features].view(out_features, in_features).t()


def unit_only_own_shard(weight_shard, out_features, in_features, x):
    n = dist.get_world_size()
    full = torch.zeros(n * weight_shard.numel())
    full[: weight_shard.numel()] = weight_shard
    return x @ full[: out_features * in_features].view(out_features, in_features).t()


@pytest.mark.parametrize("right", [zero1_right, zero1_ring])
def test_zero1_accepts_the_right_answer(right, capsys):
    ch03.check_zero1_step(right)
    out = capsys.readouterr().out
    assert "right" in out and "written to the sockets" in out      # what was measured, the wire included


def test_zero1_stub_is_not_implemented():
    with pytest.raises(NotImplementedError):
        ch03.check_zero1_step(zero1_stub)


@pytest.mark.parametrize("wrong, words", [(zero1_no_mean, "mean"), (zero1_no_gather, "all-gather"),
                                          (zero1_all_reduce, "all-reduce"), (zero1_local_grads, "own gradient"),
                                          (zero1_ddp_around_the_log, "straight through torch.distributed")])
def test_zero1_rejects_wrong_answers(wrong, words):
    with pytest.raises(ExerciseError, match=words):
        ch03.check_zero1_step(wrong)


def test_unit_accepts_the_right_answer(capsys):
    ch03.check_gather_compute_free(unit_right)
    assert "right" in capsys.readouterr().out


def test_unit_stub_is_not_implemented():
    with pytest.raises(NotImplementedError):
        ch03.check_gather_compute_free(unit_stub)


@pytest.mark.parametrize("wrong, words", [(unit_keeps_weight, "kept"), (unit_all_reduce, "twice"),
                                          (unit_only_own_shard, "all-gather the shards"),
                                          (unit_all_reduce_around_the_log, "straight through torch.distributed")])
def test_unit_rejects_wrong_answers(wrong, words):
    with pytest.raises(ExerciseError, match=words):
        ch03.check_gather_compute_free(wrong)


def muon_right(rows, owner, cfg):
    n, mine = dist.get_world_size(), dist.get_rank() == owner
    pieces = [torch.empty_like(rows) for _ in range(n)] if mine else None
    comm.gather(rows, pieces, dst=owner)
    chunks = [c.contiguous() for c in newton_schulz(torch.cat(pieces), cfg).chunk(n)] if mine else None
    out = torch.empty_like(rows)
    comm.scatter(out, chunks, src=owner)
    return out


def muon_stub(rows, owner, cfg):
    raise NotImplementedError()


def muon_per_shard(rows, owner, cfg):
    """Newton–Schulz on the local rows: no bytes, another matrix orthogonalised."""
    return newton_schulz(rows, cfg)


def muon_gather_everywhere(rows, owner, cfg):
    """Right numbers, but every rank gathers and orthogonalises every matrix."""
    n = dist.get_world_size()
    whole = torch.empty((n * rows.shape[0], rows.shape[1]), dtype=rows.dtype)
    comm.all_gather_into_tensor(whole, rows.contiguous())
    return newton_schulz(whole, cfg).chunk(n)[dist.get_rank()]


def test_muon_accepts_the_right_answer(capsys):
    ch03.check_owner_muon(muon_right)
    assert "right" in capsys.readouterr().out


def test_muon_stub_is_not_implemented():
    with pytest.raises(NotImplementedError):
        ch03.check_owner_muon(muon_stub)


@pytest.mark.parametrize("wrong, words", [(muon_per_shard, "per-shard"), (muon_gather_everywhere, "gather-everywhere")])
def test_muon_rejects_wrong_answers(wrong, words):
    with pytest.raises(ExerciseError, match=words):
        ch03.check_owner_muon(wrong)

"""Chapter 05 checks: each accepts a right answer and rejects the plausible wrong ones kept here (dX not
all-reduced, dX averaged, a collective in the column-parallel forward; a local max, no max, an unmasked target
logit, gathered logits, reductions called around minipar's log; the bias added before g, f missing, g before GeLU). Tolerance of the checks: 1e-9
in float64."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minipar import comm
from minipar.course.checks import ExerciseError
from minipar.course.ch05_tensor_parallelism import checks as ch05


# ----------------------------------------------------------------------------------------------------
# 1. Column-parallel linear
# ----------------------------------------------------------------------------------------------------

def _column(all_reduce_dx=True, average=False, gather_forward=False):
    class Column(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w_i, b_i, group):
            ctx.save_for_backward(x, w_i)
            ctx.group = group
            y = x @ w_i.T + b_i
            if gather_forward:
                comm.all_reduce(y.clone(), group=group)    # a needless collective; y itself is unchanged
            return y

        @staticmethod
        def backward(ctx, grad_y):
            x, w_i = ctx.saved_tensors
            grad_x = grad_y @ w_i
            if all_reduce_dx:
                comm.all_reduce(grad_x, group=ctx.group)
            if average:
                grad_x = grad_x / dist.get_world_size(ctx.group)
            grad_w = grad_y.reshape(-1, grad_y.shape[-1]).T @ x.reshape(-1, x.shape[-1])
            return grad_x, grad_w, grad_y.reshape(-1, grad_y.shape[-1]).sum(0), None
    return Column


def test_column_parallel_accepts_the_right_answer():
    ch05.check_column_parallel_linear(_column())


@pytest.mark.parametrize("wrong,message", [
    (dict(all_reduce_dx=False), "only your rank's part"),
    (dict(average=True), "the whole dX"),
    (dict(gather_forward=True), "no collective"),
])
def test_column_parallel_rejects(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ch05.check_column_parallel_linear(_column(**wrong))


# ----------------------------------------------------------------------------------------------------
# 2. Vocabulary-parallel loss
# ----------------------------------------------------------------------------------------------------

def _loss(global_max=True, use_max=True, mask_target=True, gather_logits=False, fused=False, direct=False):
    def loss(logits_shard, targets, vocab_start, group):
        n_local = logits_shard.shape[-1]
        if gather_logits:    # right numbers, but moves b·s·V values
            parts = [torch.empty_like(logits_shard) for _ in range(dist.get_world_size(group))]
            comm.all_gather(parts, logits_shard.contiguous(), group=group)
            logits = torch.cat(parts, -1)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   reduction="none").view(targets.shape)
        m = logits_shard.max(dim=-1).values if use_max else torch.zeros(targets.shape, dtype=logits_shard.dtype)
        if global_max:      # the wrong answer keeps each rank's own max
            comm.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = logits_shard - m.unsqueeze(-1)
        owned = (targets >= vocab_start) & (targets < vocab_start + n_local)
        local = (targets - vocab_start).clamp(0, n_local - 1)
        z_target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        if mask_target:
            z_target = z_target.masked_fill(~owned, 0.0)
        sum_exp = z.exp().sum(-1)
        if fused:           # right: both SUMs in one all-reduce of 2·b·s numbers
            both = torch.stack([z_target, sum_exp])
            comm.all_reduce(both, group=group)
            z_target, sum_exp = both[0], both[1]
        elif direct:        # right numbers, but the SUMs go straight through torch.distributed
            dist.all_reduce(z_target, group=group)
            dist.all_reduce(sum_exp, group=group)
        else:
            comm.all_reduce(z_target, group=group)
            comm.all_reduce(sum_exp, group=group)
        return sum_exp.log() - z_target
    return loss


@pytest.mark.parametrize("right", [dict(), dict(fused=True)])
def test_vocab_loss_accepts_the_right_answer(right, capsys):
    ch05.check_vocab_parallel_loss(_loss(**right))
    assert "written to the sockets" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,message", [
    (dict(global_max=False), "global max"),
    (dict(use_max=False), "overflows"),
    (dict(mask_target=False), "contribute 0"),
    (dict(gather_logits=True), "never gather"),
    (dict(direct=True), "straight through torch.distributed"),
])
def test_vocab_loss_rejects(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ch05.check_vocab_parallel_loss(_loss(**wrong))


# ----------------------------------------------------------------------------------------------------
# 3. f and g in the MLP
# ----------------------------------------------------------------------------------------------------

def mlp_right(x, fc_w_i, fc_b_i, proj_w_i, proj_b, group, f, g):
    return g(F.linear(F.gelu(F.linear(f(x), fc_w_i, fc_b_i)), proj_w_i)) + proj_b


def mlp_bias_before_g(x, fc_w_i, fc_b_i, proj_w_i, proj_b, group, f, g):
    return g(F.linear(F.gelu(F.linear(f(x), fc_w_i, fc_b_i)), proj_w_i, proj_b))


def mlp_without_f(x, fc_w_i, fc_b_i, proj_w_i, proj_b, group, f, g):
    return g(F.linear(F.gelu(F.linear(x, fc_w_i, fc_b_i)), proj_w_i)) + proj_b


def mlp_g_before_gelu(x, fc_w_i, fc_b_i, proj_w_i, proj_b, group, f, g):
    return F.linear(F.gelu(g(F.linear(f(x), fc_w_i, fc_b_i))), proj_w_i) + proj_b


def test_mlp_accepts_the_right_answer():
    ch05.check_tp_mlp(mlp_right)


@pytest.mark.parametrize("wrong,message", [
    (mlp_bias_before_g, "counts t times"),
    (mlp_without_f, "f must wrap x|one forward \\(g\\), one backward \\(f\\)"),
    (mlp_g_before_gelu, "not before GeLU"),
])
def test_mlp_rejects(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ch05.check_tp_mlp(wrong)

"""ZeRO-Offload: the optimizer step on host copies gives exactly the same training; nothing of the optimizer
stays on the device; the bytes crossing the bus per step are the gradient shard and the parameter shard."""

from minipar import launch
from minipar.check import RunResult, compare, gpt_recipe, train_reference
from minipar.data.offload import offloaded
from minipar.data.zero import ZeRO
from minipar.data.zero_measure import measured_zero_state_bytes
from minipar.loop import mean_over_ranks, shard_batch

RECIPE = gpt_recipe(steps=3, batch_size=8, seq_len=16, optimizer="adam")


def _train(rank, world_size, recipe, offload):
    model = recipe.model()
    factory = offloaded(recipe.optimizer) if offload else recipe.optimizer
    sharded = ZeRO(model, factory, stage=2)
    losses = []
    for x, y in recipe.batches:
        x, y = shard_batch((x, y), rank, world_size)
        sharded.zero_grad()
        loss = recipe.loss(model, x, y)
        loss.backward()
        sharded.step()
        losses.append(mean_over_ranks(loss))
    opt = sharded.optimizer
    extra = {"device": measured_zero_state_bytes(sharded), "psi": sharded.padded_numel}
    if offload:
        extra.update(host=opt.host_bytes(), to_host=opt.bytes_to_host, to_device=opt.bytes_to_device)
    return RunResult(losses, sharded.full_parameters()), extra


def _both(rank, world_size, recipe):
    return _train(rank, world_size, recipe, False), _train(rank, world_size, recipe, True)


def test_offload_is_exact_and_moves_the_optimizer_to_the_host():
    n = 2
    results = launch(_both, n, RECIPE, quiet=True)
    plain, off = [r[0][0] for r in results], [r[1][0] for r in results]
    compare(train_reference(RECIPE), off).assert_ok()                    # default FP32 tolerance
    compare(plain[0], off, atol=0, rtol=0).assert_ok()                  # the same arithmetic, elsewhere
    for (_, p_extra), (_, o_extra) in results:
        psi = o_extra["psi"]
        assert p_extra["device"]["optimizer"] == 8 * psi // n           # Adam's m, v on the device ...
        assert o_extra["device"]["optimizer"] == 0                      # ... or none of it
        assert o_extra["host"] == 12 * psi // n                         # FP32 master + m + v on the host
        assert o_extra["to_host"] == o_extra["to_device"] == RECIPE.steps * 4 * psi // n

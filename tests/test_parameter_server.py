"""Parameter server: equals one device (float32 tolerance of minipar.check); the server's traffic is
(N-1)·P per step and a worker's is P, measured in the communication log."""
import pytest

from minipar import comm, launch
from minipar.check import check_equivalence, gpt_recipe
from minipar.data import parameter_server as ps


def test_four_ranks_match_one_device():
    check_equivalence(ps.parallel_train, 4, gpt_recipe(steps=3, batch_size=8),
                      launch_kwargs=dict(quiet=True)).assert_ok()


def test_server_on_another_rank_matches_too():
    check_equivalence(ps.parallel_train, 2, gpt_recipe(steps=2, batch_size=8), server=1,
                      launch_kwargs=dict(quiet=True)).assert_ok()


def _traffic(rank, world_size, recipe):
    log = comm.CommLog()
    ps.parallel_train(rank, world_size, recipe, step_log=log)
    return log.bytes_sent / recipe.steps, log.bytes_received / recipe.steps


@pytest.mark.parametrize("n", [2, 4])
def test_server_traffic_grows_with_n_workers_stays_constant(n):
    recipe = gpt_recipe(steps=1, batch_size=8)
    p = sum(t.numel() * 4 for t in recipe.model().parameters())
    traffic = launch(_traffic, n, recipe, quiet=True)
    assert traffic[0] == ((n - 1) * p, (n - 1) * p)                 # server: pull out, push in
    assert all(t == (p, p) for t in traffic[1:])                     # workers: push out, pull in
    assert [t[0] for t in traffic] == [ps.parameter_server_bytes_sent(r, n, p) for r in range(n)]


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="at least 2"):
        ps.run(gpt_recipe(steps=1), world_size=1)
    with pytest.raises(ValueError, match="not divisible"):
        ps.run(gpt_recipe(steps=1, batch_size=6), world_size=4)

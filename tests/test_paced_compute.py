"""minipar.observe.paced_compute: a block's forward and backward held to their slots, the slots begin after a
strategy's hooks (a gather not prefetched is paid outside the slot), a gradient hook fires inside the
backward slot (a bucket leaves before the sleep), the numbers are the unpaced model's, and the alternating
step timer takes the slowest rank. Timings are checked by lower bounds (sleeps) or by order, never by how fast
a loaded machine is."""
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

from minipar.launcher import launch
from minipar.observe.busy import DISTURBED_SHARE, LATE_WAKE_S, OTHER_CORES, OtherWork, disturbed, too_busy
from minipar.observe.paced_compute import alternating_steps, median_wake, pace, spread, verdict

F, B = 0.06, 0.08          # slots (s)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def blocks(n=2, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*(Block() for _ in range(n)))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def test_slots_hold_forward_and_backward_and_change_no_number():
    plain, paced_model = blocks(), blocks()
    pacer = pace(list(paced_model), F, B)
    x = torch.randn(3, 4, requires_grad=True)
    y, forward = timed(lambda: paced_model(x))
    pacer.late = 0.0        # (a slot begins earlier by how late the last sleep woke: forgiven, not tested here)
    _, backward = timed(lambda: y.square().sum().backward())
    assert forward >= 1.5 * F and backward >= 1.5 * B
    assert pacer.held == 4 and pacer.unpaced == 0
    want = plain(x.detach().requires_grad_())
    want.square().sum().backward()
    assert torch.equal(y, want)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(paced_model.parameters(), plain.parameters()))
    pacer.remove()
    _, again = timed(lambda: paced_model(x))
    assert again < F and "forward" not in paced_model[0].__dict__
    with pytest.raises(ValueError, match="positive"):
        pace(list(paced_model), 0.0, B)
    pace(list(paced_model), F, B)
    with pytest.raises(ValueError, match="paced already"):
        pace(list(paced_model), F, B)


def test_a_strategys_hooks_run_outside_the_slot():
    """A forward pre-hook (ZeRO-3's gather) and a tensor hook on the output registered by a forward hook (its
    gather for the backward) are paid before the slot begins: they add to it."""
    model = blocks(1)
    block = model[0]
    wait = 0.07
    block.register_forward_pre_hook(lambda m, a: time.sleep(wait))
    block.register_forward_hook(lambda m, a, out: (out.register_hook(lambda g: time.sleep(wait)), None)[1])
    pacer = pace([block], F, B)
    x = torch.randn(3, 4, requires_grad=True)
    y, forward = timed(lambda: model(x))
    pacer.late = 0.0
    _, backward = timed(lambda: y.sum().backward())
    assert forward >= wait + F and backward >= wait + B


def test_a_gradient_hook_fires_inside_the_backward_slot():
    """DDP launches a bucket from a parameter's post-accumulate hook: that must run before the slot's sleep,
    so that the bucket travels during it."""
    model = blocks(1)
    slow_b = 0.3
    pacer = pace([model[0]], F, slow_b)
    fired = []
    model[0].fc.weight.register_post_accumulate_grad_hook(lambda p: fired.append(time.perf_counter()))
    y = model(torch.randn(3, 4, requires_grad=True))
    pacer.late = 0.0
    start = time.perf_counter()
    y.sum().backward()
    end = time.perf_counter()
    assert end - start >= slow_b and fired[0] - start < slow_b       # before the sleep, not after it


def test_unpaced_backward_and_overruns_are_counted():
    model = blocks(1)
    pacer = pace([model[0]], 1e-6, 1e-6)
    model(torch.randn(3, 4)).sum().backward()                         # no input needs a gradient
    assert pacer.unpaced == 1 and pacer.overruns >= 1
    assert disturbed(6, 100, load=0.5, cores=2) and not disturbed(5, 100, load=0.5, cores=2)


def test_a_load_average_over_twice_the_cores_disturbs_any_run():
    """More runnable processes than twice the cores: ranks wake late at their slots' ends without overrunning
    (chapter 04's 1F1B once idled 44.5 % against 27.3 %), so no paced comparison is made, and the line says why."""
    assert disturbed(0, 100, load=4.5, cores=2) and not disturbed(0, 100, load=4.0, cores=2)
    assert not disturbed(0, 100, load=30.0, cores=16) and too_busy(0, 100, load=1.0, cores=2) == ""
    busy = too_busy(0, 100, load=9.0, cores=2)
    assert "load average 9.0 on 2 cores" in busy and "not compared" in busy and "slots ran long" not in busy
    assert "more than 5% of the slots ran long (load average 1.0 on 2 cores)" in too_busy(6, 100, load=1.0, cores=2)


def test_a_run_that_measured_its_wake_ups_is_judged_by_them_not_by_the_load_average():
    """A paced run that gives the median of how late its ranks woke from their slots is disturbed when that median
    is over LATE_WAKE_S (other work held the cores), whatever the load average, which also counts a chapter's
    earlier runs for a minute after they ended; overruns still disturb it."""
    assert not disturbed(0, 100, load=9.0, cores=2, late=0.0002)         # the load of earlier runs: not this one's
    assert disturbed(0, 100, load=0.5, cores=2, late=0.003)
    assert disturbed(6, 100, load=0.5, cores=2, late=0.0)
    assert too_busy(0, 100, load=9.0, cores=2, late=0.0002) == ""
    busy = too_busy(0, 100, load=3.0, cores=2, late=0.0031)
    assert "woke a median 3.1 ms after their slots' ends, over 1 ms" in busy and "load average 3.0 on 2 cores" in busy


def test_the_pacer_records_how_late_each_sleep_woke_and_median_wake_reads_it():
    model = blocks(2)
    pacer = pace(list(model), 0.002, 0.002)
    for _ in range(3):
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert len(pacer.woke_late) == pacer.held - pacer.overruns and all(t >= 0 for t in pacer.woke_late)
    assert median_wake([pacer]) == sorted(pacer.woke_late)[len(pacer.woke_late) // 2]


def test_verdict_and_spread():
    assert verdict([1, 2, 3], [4, 5, 6]) == "apart"
    assert verdict([1, 2, 2, 2, 9], [4, 5, 6]) == "median outside"          # one slow step widens a range
    assert verdict([1, 2, 3], [2.5, 9, 9]) == "median outside"              # the slow median above every fast step
    assert verdict([1, 4, 6], [3, 5, 7]) == "tie" and verdict([4, 5, 6], [1, 2, 3]) == "tie"
    assert spread([0.010, 0.012, 0.020]) == "12.0 [10.0 – 20.0] ms"


def _alternating(rank, world_size):
    order = []
    steps = {"a": lambda: order.append("a"), "b": lambda: (order.append("b"), time.sleep(0.05 * rank))}
    return alternating_steps(steps, 3), order


def test_alternating_steps_alternate_and_time_the_slowest_rank():
    (seconds, order), _ = launch(_alternating, 2, quiet=True)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert all(s >= 0.05 for s in seconds["b"]) and len(seconds["a"]) == 3


def test_alternating_steps_time_each_step_on_one_intra_op_thread():
    """In this process too, as in a launched rank: two threads on a busy two-core machine made a 10 ms step
    take up to a second. The caller's thread count comes back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        alternating_steps({"a": lambda: seen.append(torch.get_num_threads())}, 2, warmup=1)
        assert seen == [1, 1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_other_processes_cpu_disturbs_a_run_whose_ranks_woke_on_time():
    """Beside make test's other streams chapter 03's ranks woke on time (5 of 192 slots long) yet computed among
    them and tied: other processes' CPU while the run ran, over OTHER_CORES, disturbs it whatever the wake-ups."""
    assert disturbed(0, 100, load=0.5, cores=2, late=0.0002, other=1.2)
    assert not disturbed(0, 100, load=9.0, cores=2, late=0.0002, other=0.01)
    assert disturbed(0, 100, load=0.5, cores=2, late=0.004, other=0.01)
    busy = too_busy(0, 100, load=2.1, cores=2, late=0.0003, other=1.2)
    assert busy.startswith("other processes used 1.2 of the 2 cores while it ran, over 0.25") and "not compared" in busy


def test_other_work_measures_the_cpu_of_processes_not_its_own():
    """A busy process started outside the block is other work (quiet: about a core; under make test's streams,
    more); OtherWork's cores are None only without /proc/stat."""
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        with OtherWork() as other:
            time.sleep(0.5)
    finally:
        spinning.kill()
        spinning.wait()
    assert other.cores is None or other.cores > OTHER_CORES, other.cores


@pytest.mark.parametrize("notebook", ["02_data_parallelism.ipynb", "03_zero_and_fsdp.ipynb"])
def test_each_paced_chapters_fold_states_the_rules_the_code_applies(notebook):
    """A paced run prints only whether the machine was quiet; its chapter's fold ("How ... measured") states the
    rules in words: they must be the thresholds minipar.observe.busy applies."""
    import json
    from minipar.course import ROOT
    nb = json.loads((ROOT / "notebooks" / notebook).read_text())
    text = " ".join(" ".join("".join(c["source"]).split()) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert (OTHER_CORES, DISTURBED_SHARE, LATE_WAKE_S) == (0.25, 0.05, 0.001)
    for words in ("at most 5 %", "over a quarter of a core", "a median under 1 ms late"):
        assert words in text, (notebook, words)

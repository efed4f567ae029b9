"""minipar.memory: counts what really exists, once per storage."""
import torch

from minipar.memory import LiveTensorTracker, measure_step, measured_model_state_bytes, saved_activation_bytes
from minipar.models import MLP


def test_live_tensor_tracker_sees_allocations_and_frees():
    with LiveTensorTracker() as tracker:
        a = torch.empty(1000)                        # 4000 bytes
        b = a * 2                                    # +4000
        view = b[:10]                                # a view allocates nothing
        assert tracker.current == 8000
        del a
        assert tracker.current == 4000
        del b                                        # still held by the view
        assert tracker.current == 4000
        del view
        assert tracker.current == 0
    assert tracker.peak == 8000


def test_model_state_counts_tied_weights_once():
    lin = torch.nn.Linear(10, 10, bias=False)
    params = [lin.weight, lin.weight]
    assert measured_model_state_bytes(params)["params"] == 400


def test_measure_step_for_an_mlp_with_adam():
    model = MLP((32, 256, 32), seed=0)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 32)
    psi = sum(p.numel() for p in model.parameters())

    def step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    first = measure_step(step, model.parameters(), opt)
    assert first.params == first.grads == 4 * psi
    assert first.optimizer == 2 * 4 * psi                 # Adam: exp_avg and exp_avg_sq
    # saved for backward: the input of each Linear (x, gelu output), the pre-activation for GeLU, the output
    # for pow -- exactly 64·(32 + 256 + 256 + 32) floats
    activations = 4 * 64 * (32 + 256 + 256 + 32)
    assert first.activations == activations
    # On the first step gradients and Adam's state appear only after the activations are freed, so the
    # peak is below the sum of everything; from the second step on, the state exists all the time.
    second = measure_step(step, model.parameters(), opt)
    at_end_of_forward = second.params + second.optimizer + activations - 4 * 64 * 32  # x existed before
    # Upper bound: Adam's foreach update allocates temporaries of a few Ψ (sqrt of exp_avg_sq, ...).
    assert at_end_of_forward <= second.peak <= second.model_states + activations + 4 * (4 * psi)
    assert first.peak < second.peak


def test_saved_activation_bytes_excludes_parameters():
    lin = torch.nn.Linear(100, 100)
    x = torch.randn(8, 100, requires_grad=True)
    _, saved = saved_activation_bytes(lambda: lin(x), exclude=list(lin.parameters()))
    assert saved == 8 * 100 * 4                           # only the input; the weight is not a copy


def test_saved_activation_bytes_asks_a_callable_exclude_at_each_save():
    """ZeRO-3 gathers a parameter inside the forward: a list taken before the call would miss it."""
    lin = torch.nn.Linear(100, 100)
    x = torch.randn(8, 100, requires_grad=True)
    gathered = []

    def forward():
        w = lin.weight.detach().clone().requires_grad_()     # a new storage, made during the forward
        gathered.append(w)
        return torch.nn.functional.linear(x, w)

    _, stale = saved_activation_bytes(forward, exclude=[lin.weight])
    assert stale == 8 * 100 * 4 + 100 * 100 * 4               # the gathered weight counted as an activation
    _, saved = saved_activation_bytes(forward, exclude=lambda: gathered)
    assert saved == 8 * 100 * 4


def test_measure_step_counts_a_gradient_the_step_frees_and_recreates_once():
    """zero_grad(set_to_none=True) frees the gradients made before the step; backward makes new ones. The
    peak of the second step equals the first's (same allocations, the old gradients gone): before the fix
    it was higher by the gradients' bytes (counted once in the state before, once as new)."""
    model = MLP((32, 256, 32), seed=0)
    x = torch.randn(64, 32)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    first = measure_step(step, model.parameters())
    second = measure_step(step, model.parameters())
    assert first.grads == second.grads > 0
    assert second.peak == first.peak, (first.peak, second.peak, first.grads)


def test_measure_step_keeps_counting_state_the_step_does_not_free():
    model = MLP((32, 256, 32), seed=0)
    x = torch.randn(64, 32)

    def accumulate():                     # no zero_grad: the old gradients stay and are added to
        model(x).pow(2).mean().backward()

    accumulate()
    acc = measure_step(accumulate, model.parameters())
    assert acc.peak >= acc.params + acc.grads + acc.activations

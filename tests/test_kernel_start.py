"""Solution notebooks' kernels (nbval) survive jupyter's port race: a kernel that dies at start is started again."""
import nbval.kernel

from conftest import start_kernel_retrying


def test_a_kernel_that_dies_at_start_is_started_again():
    calls = []

    def start(**kwargs):
        calls.append(kwargs)
        if len(calls) < 3:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return "km", "kc"
    assert start_kernel_retrying(start)(kernel_name="python3") == ("km", "kc") and len(calls) == 3


def test_the_third_death_is_an_error():
    def start(**kwargs):
        raise RuntimeError("Kernel died before replying to kernel_info")
    try:
        start_kernel_retrying(start)()
    except RuntimeError as e:
        assert "kernel_info" in str(e)
    else:
        raise AssertionError("no error after three deaths")


def test_nbval_starts_its_kernels_through_the_retry():
    assert getattr(nbval.kernel.start_new_kernel, "retrying", False)

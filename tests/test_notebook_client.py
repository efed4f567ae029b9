"""tools/notebook_client.py: a shell wait that misses its wake-up costs one slice, not the cell's timeout."""
import asyncio
import sys
import time
from pathlib import Path
from queue import Empty

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from notebook_client import SlicedClient, sliced  # noqa: E402


class MissedWakeup:
    """A channel whose reply is already there, but whose first poll sleeps out its whole timeout (the lost
    wake-up of nbclient issue #312); every later poll sees the reply."""

    def __init__(self):
        self.polls = []

    async def get_msg(self, timeout=None):
        self.polls.append(timeout)
        if len(self.polls) == 1:
            await asyncio.sleep(timeout)
            raise Empty
        return {"msg_type": "execute_reply"}


def test_a_missed_wakeup_costs_one_slice():
    channel = MissedWakeup()
    start = time.monotonic()
    msg = asyncio.run(sliced(channel.get_msg, slice_seconds=0.05)(timeout=600))
    assert msg["msg_type"] == "execute_reply"
    assert time.monotonic() - start < 5                     # unsliced, this waits the 600 s
    assert channel.polls == [0.05, 0.05]


def test_the_cells_timeout_still_holds():
    async def never(timeout=None):
        await asyncio.sleep(timeout)
        raise Empty
    start = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(sliced(never, slice_seconds=0.05)(timeout=0.3))
    assert 0.3 <= time.monotonic() - start < 2


def test_the_synchronous_kernel_start_gets_the_sliced_client_too():
    """SharedKernel starts its kernel with nbclient's synchronous setup_kernel(), whose start_new_kernel_client is
    bound to NotebookClient's own async method when that class is made: SlicedClient must rebind it, or the shared
    kernel's client waits unsliced (make test's build once waited 590 s on chapter 07's widget cell)."""
    from nbclient import NotebookClient
    assert SlicedClient.start_new_kernel_client is not NotebookClient.start_new_kernel_client

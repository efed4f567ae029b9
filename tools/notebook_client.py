"""The notebook client the site build runs chapters with: nbclient's, its wait for a cell's reply made safe.

Why: a chapter's ``ipywidgets.interact`` shows its output in an Output widget, which nbclient plays the frontend
for (``nbclient.output_widget``): while a cell runs it sends the widget's state to the kernel as ``comm_msg`` on
the shell socket, and another coroutine waits on that same socket (``zmq.asyncio`` poll) for the cell's
``execute_reply``. When the send and the reply cross, the wait can miss the reply's wake-up and sleep until its
own timeout although the reply sits in the socket (nbclient issue #312, "when cell contains ipywidget, execute
cell will sometimes block"). Seen here: the kernel's debug log shows the reply sent at 04:25:34.418, the client's
log the cell's ``idle`` at 04:25:34.426, then nothing for ten minutes, with the kernel idle — in 2 of about 15
runs of chapters 03 and 12 while other work loaded both cores, and in 3 of 6 ``make test`` runs (each cost 600 s).

The fix: wait in slices of ``SLICE`` seconds. A fresh poll finds a reply that is already in the socket, so a
missed wake-up costs at most one slice; the cell's own timeout is kept.
"""
from __future__ import annotations

import time
from queue import Empty

from nbclient import NotebookClient

SLICE = 1.0     # seconds: the most a missed wake-up can cost


def sliced(get_msg, slice_seconds: float = SLICE):
    """``get_msg(timeout)`` of a jupyter_client channel, polling at most ``slice_seconds`` at a time; Empty only
    once ``timeout`` (None: never) has passed."""
    async def get(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return await get_msg(timeout=slice_seconds if left is None else max(0.0, min(slice_seconds, left)))
            except Empty:
                if left is not None and left <= slice_seconds:
                    raise
    return get


class SlicedClient(NotebookClient):
    """:class:`nbclient.NotebookClient` whose kernel client waits for shell replies in slices (see above)."""

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        kc.shell_channel.get_msg = sliced(kc.shell_channel.get_msg)
        return kc

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

:class:`SharedKernel` runs many notebooks one after another in one kernel (make test's site build and its
exercise tests): a kernel's start costs about 8 s of CPU on a 2-core machine (torch's import, then
torch._dynamo's on the first optimizer, pyplot's), some 3 minutes over the course's notebooks.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from queue import Empty

from nbclient import NotebookClient
from nbclient.util import run_sync

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

    # nbclient's synchronous twin is bound to its own async method when its class is made: without this line
    # setup_kernel() (SharedKernel's start) would get an unsliced client (a 590 s wait, seen in make test's build)
    start_new_kernel_client = run_sync(async_start_new_kernel_client)


# What a notebook may leave behind in a kernel that `%reset -f` does not clear: figures, torch's default dtype
# and its global random state (a fresh kernel starts at torch's fixed initial seed), the working folder and
# the cell counter (the next cell is [1], as in a fresh kernel).
RESET = ("%reset -f\nimport os, torch, matplotlib.pyplot\nmatplotlib.pyplot.close('all')\n"
         "torch.set_default_dtype(torch.float32)\ntorch.manual_seed({seed})\nos.chdir({folder!r})\n"
         "get_ipython().execution_count = 1")


class SharedKernel:
    """One kernel for many notebooks, run one after another: before each, the names the last one defined are
    cleared, its figures closed, torch's default dtype and random state put back as a fresh kernel has them and
    the working folder becomes the notebook's own (``RESET``, a cell run before the notebook's and not kept in
    it). A kernel that died, or did not start, is replaced for the next notebook; one that dies at start
    (jupyter's port race, see conftest.start_kernel_retrying) is started again, up to three times.
    ``client_class`` and ``options``: the nbclient client each notebook is run with, and its arguments."""

    def __init__(self, client_class=NotebookClient, env: dict | None = None, **options):
        import torch
        self.client_class, self.env, self.options = client_class, env, options
        self.stack, self.client, self.language_info = ExitStack(), None, None
        self.seed = torch.Generator().initial_seed()            # torch's default, a fresh kernel's

    def _start(self, nb, folder) -> None:
        for attempt in range(1, 4):
            client = self.client_class(nb, resources={"metadata": {"path": str(folder)}}, **self.options)
            try:
                self.stack.enter_context(client.setup_kernel(**({"env": self.env} if self.env else {})))
            except RuntimeError:
                self.close()
                if attempt == 3:
                    raise
                continue
            self.client = client
            reply = client.wait_for_reply(client.kc.kernel_info())
            self.language_info = (reply or {}).get("content", {}).get("language_info")
            return

    def run(self, nb, folder) -> None:
        """Execute ``nb`` (in place) in ``folder``, errors kept in its cells' outputs. A kernel that dies raises
        nbclient's DeadKernelError here; the next notebook gets a fresh kernel."""
        import nbformat
        from nbclient.exceptions import DeadKernelError
        if self.client is None:
            self._start(nb, folder)
        client, reset = self.client, nbformat.v4.new_code_cell(RESET.format(seed=self.seed, folder=str(folder)))
        nb.cells.insert(0, reset)
        client.nb = nb
        client.reset_execution_trackers()
        try:
            for i, cell in enumerate(nb.cells):
                if cell.cell_type == "code":
                    client.execute_cell(cell, i)
            if self.options.get("store_widget_state"):
                client.set_widgets_metadata()
        except DeadKernelError:
            self.close()
            raise
        finally:
            del nb.cells[0]                      # the reset cell
        if self.language_info:
            nb.metadata["language_info"] = self.language_info

    def close(self) -> None:
        self.stack.close()
        self.stack, self.client = ExitStack(), None

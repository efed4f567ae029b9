"""The one hook interface every instrument registers on, and the scope it is registered for.

An instrument -- the comm log (:func:`minipar.comm_log.recording`), the wire counter
(:mod:`minipar.wire`), the tracer (:mod:`minipar.observe.tracer`), the flight recorder (:mod:`minipar.flight`),
the desync check (:mod:`minipar.debug.desync`), the launch tracer (:mod:`minipar.observe.launch_trace`) -- is
an object with one or both of two methods:

* ``around_call(call, proceed) -> result``: wraps one call through :mod:`minipar.comm`. ``call`` says what is
  called (:class:`minipar.calls.Call`: op, group, peer, tensor, the model's bytes; after ``proceed()``: its
  ``seconds`` and its :attr:`~minipar.calls.Call.record`); ``proceed()`` runs the inner hooks and the call
  itself and returns its result, which the hook returns -- an async call's work, which it may hand back
  wrapped (:class:`WorkDone`). A hook may raise instead of proceeding (the desync check).
* ``around_launch(fn, world_size) -> (fn, finish)``: the function each rank of a :func:`minipar.launch` runs
  instead of ``fn``, and ``finish(results) -> results``, which undoes the wrapping on the per-rank results.

Hooks are scoped, not registered on process-wide lists: ``with installed(hook):`` makes ``hook`` active for the
block, in this thread (a ``ContextVar``, as :func:`minipar.comm.ring_algorithms`; a thread started inside
begins with none, so a call made from another thread -- a CUDA device's autograd thread -- is not seen).
Hooks installed earlier are the outer ones: the outermost wraps the rest. A rank the launcher starts begins
a scope of its own (:func:`only`): a forked rank does not carry its parent's hooks. :mod:`minipar.comm` and
:mod:`minipar.launcher` ask :func:`active` and know no instrument by name (each scope filters its hooks by
method once, when first asked: :func:`active` runs on every call). This module imports nothing of minipar.
"""
from __future__ import annotations

import contextlib
import contextvars

__all__ = ["installed", "only", "active", "WorkDone"]

class _Scope:
    """The hooks active in one block, and, per method, those that have it: asked on every call through
    :mod:`minipar.comm`, so filtered once per scope, not once per call."""

    __slots__ = ("hooks", "having")

    def __init__(self, hooks: tuple):
        self.hooks, self.having = hooks, {}

    def with_method(self, method: str) -> tuple:
        found = self.having.get(method)
        if found is None:
            found = self.having[method] = tuple(h for h in self.hooks if hasattr(h, method))
        return found


_NONE = _Scope(())
_active: contextvars.ContextVar = contextvars.ContextVar("minipar_hooks", default=_NONE)


@contextlib.contextmanager
def installed(*hooks):
    """Make ``hooks`` active inside the block (after, i.e. inside, those already active); yields them."""
    for hook in hooks:
        if not (hasattr(hook, "around_call") or hasattr(hook, "around_launch")):
            raise TypeError(f"{hook!r} is no hook: it has neither around_call nor around_launch")
    token = _active.set(_Scope(_active.get().hooks + hooks))
    try:
        yield hooks[0] if len(hooks) == 1 else hooks
    finally:
        _active.reset(token)


@contextlib.contextmanager
def only(*hooks):
    """Exactly ``hooks`` active inside the block, none of those outside it (a rank process's own scope)."""
    token = _active.set(_NONE)
    try:
        with installed(*hooks) as installed_hooks:
            yield installed_hooks
    finally:
        _active.reset(token)


def active(method: str | None = None) -> tuple:
    """The hooks active here, outermost first; with ``method``, only those that have it."""
    scope = _active.get()
    return scope.hooks if method is None else scope.with_method(method)


class WorkDone:
    """An async call's work that calls ``done()`` when it sees the call complete: when its ``wait()`` returns
    or ``is_completed()`` says so (gloo's send/recv works have no future to call back). Everything else is
    the work's own."""

    def __init__(self, work, done):
        self._work, self._done = work, done

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._done()
        return out

    def is_completed(self) -> bool:
        finished = self._work.is_completed()
        if finished:
            self._done()
        return finished

    def __getattr__(self, name):
        return getattr(self._work, name)

"""Dual-batch overlap (DBO) micro-batch contexts, CPU part (vLLM ``vllm/v1/worker/ubatching.py``, 0.17.0 and 0.33.0
alike).

Under DBO a step runs as N micro-batches ("ubatches") on N threads of which exactly one runs at a time; a ubatch hands
the CPU to the next one with ``dbo_yield`` (round robin). The modular kernel uses four functions (``fused_moe/
modular_kernel.py``, ``_prepare`` / ``_finalize``):

- ``dbo_enabled()``: whether the calling thread runs inside a ubatch context;
- ``dbo_register_recv_hook(hook)``: store ``hook`` in the *next* ubatch's context (it is not run now);
- ``dbo_yield()``: let the next ubatch run until it yields back;
- ``dbo_maybe_run_recv_hook()``: run (and clear) the hook another ubatch registered in this one's context; a
  context also runs it when it exits.

So the hook an async prepare/finalize returns is, under DBO, run by *another* ubatch (at that ubatch's next
``dbo_maybe_run_recv_hook``), after which the registering ubatch, once resumed, calls the receiver. vLLM's streams and
GPU events (``switch_to_comm`` / ``switch_to_compute``) are not modelled: the reference runs on one stream, where they
order nothing.

``run_ubatches(fns)`` is this module's driver (vLLM's ``UBatchWrapper`` starts the threads the same way): it runs
``fns[i]()`` as ubatch ``i``, ubatch 0 first, and returns their results in order (an exception in a ubatch is
re-raised after every thread finished).
"""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["UBatchContext", "dbo_enabled", "dbo_current_ubatch_id", "dbo_yield", "dbo_register_recv_hook",
           "dbo_maybe_run_recv_hook", "run_ubatches"]

_THREAD_ID_TO_CONTEXT: dict[int, int] = {}
_CURRENT_CONTEXTS: list["UBatchContext | None"] = []
_NUM_UBATCHES = 0


class UBatchContext:
    """One ubatch's context (vLLM ``UBatchContext`` without streams): entered on its thread, it waits for its turn;
    ``yield_`` wakes the next ubatch and sleeps; exiting runs a pending recv hook and wakes the next ubatch."""

    def __init__(self, id: int, ready_barrier: threading.Barrier, cpu_wait_event: threading.Event,
                 cpu_signal_event: threading.Event):
        self.id = id
        self.ready_barrier = ready_barrier
        self.cpu_wait_event = cpu_wait_event
        self.cpu_signal_event = cpu_signal_event
        self.recv_hook: Callable[[], object] | None = None

    def __enter__(self):
        _THREAD_ID_TO_CONTEXT[threading.get_ident()] = self.id
        _CURRENT_CONTEXTS[self.id] = self
        self.ready_barrier.wait()
        self.cpu_wait_event.wait()
        self.cpu_wait_event.clear()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        _CURRENT_CONTEXTS[self.id] = None
        del _THREAD_ID_TO_CONTEXT[threading.get_ident()]
        try:
            self.maybe_run_recv_hook()
        finally:
            self.cpu_signal_event.set()
            self.cpu_wait_event.clear()
        return False

    def maybe_run_recv_hook(self) -> None:
        if self.recv_hook is not None:
            hook, self.recv_hook = self.recv_hook, None
            hook()

    def yield_(self) -> None:
        if _CURRENT_CONTEXTS[(self.id + 1) % _NUM_UBATCHES] is None:
            return  # the next ubatch has finished: nobody would wake this one (vLLM's ubatches yield symmetrically)
        assert not self.cpu_wait_event.is_set()
        self.cpu_signal_event.set()
        self.cpu_wait_event.wait()
        self.cpu_wait_event.clear()


def _ctx() -> UBatchContext | None:
    idx = _THREAD_ID_TO_CONTEXT.get(threading.get_ident())
    return None if idx is None else _CURRENT_CONTEXTS[idx]


def dbo_enabled() -> bool:
    """vLLM: ``len(_THREAD_ID_TO_CONTEXT) > 0`` (some ubatch context is active)."""
    return len(_THREAD_ID_TO_CONTEXT) > 0


def dbo_current_ubatch_id() -> int:
    """The calling ubatch's index (0 without DBO)."""
    return _THREAD_ID_TO_CONTEXT.get(threading.get_ident(), 0)


def dbo_yield() -> None:
    ctx = _ctx()
    if ctx is not None:
        ctx.yield_()


def dbo_maybe_run_recv_hook() -> None:
    ctx = _ctx()
    if ctx is not None:
        ctx.maybe_run_recv_hook()


def dbo_register_recv_hook(recv_hook: Callable[[], object]) -> None:
    """Store ``recv_hook`` in the next ubatch's context (vLLM: ``_CURRENT_CONTEXTS[(idx + 1) % N]``)."""
    idx = _THREAD_ID_TO_CONTEXT.get(threading.get_ident())
    if idx is not None:
        nxt = _CURRENT_CONTEXTS[(idx + 1) % _NUM_UBATCHES]
        if nxt is None:  # the next ubatch already finished: nobody else will run it
            recv_hook()
        else:
            nxt.recv_hook = recv_hook


def run_ubatches(fns: list[Callable[[], object]]) -> list[object]:
    """Run ``fns`` as ubatches 0..N-1 (N >= 2) on N threads, one at a time, ubatch 0 first; return their results.

    Raises:
        ValueError: fewer than two ubatches. Whatever a ubatch raised (the first, by ubatch index).
    """
    global _NUM_UBATCHES
    n = len(fns)
    if n < 2:
        raise ValueError(f"DBO needs at least two ubatches, got {n}")
    if _THREAD_ID_TO_CONTEXT:
        raise RuntimeError("run_ubatches is not reentrant")
    _NUM_UBATCHES = n
    _CURRENT_CONTEXTS[:] = [None] * n
    barrier = threading.Barrier(n + 1)
    events = [threading.Event() for _ in range(n)]
    ctxs = [UBatchContext(i, barrier, events[i], events[(i + 1) % n]) for i in range(n)]
    results: list[object] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(i: int) -> None:
        try:
            with ctxs[i]:
                results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    events[0].set()  # ubatch 0 starts
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results

"""Rewards agents call, and the worker processes that grade. ``math_equal`` grades a math answer with
math-verify: it finds the model's answer (its ``\\boxed{}``, else its last expression) and compares it with
the label symbolically, so ``\\frac{1}{2}``, ``1/2`` and ``0.5`` agree, as do sets, intervals and ``1,000``
and ``1000``.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.connection
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Any


@functools.cache  # one pool per process, made on first use
def grading_pool() -> ProcessPoolExecutor:
    """Worker processes for CPU-bound grading. A task runs on a worker's main thread, the only thread where
    signal-based time limits (math-verify's) work, and never holds up the agent runner's event loop. The
    workers fork from a server process that imported this module once (never from a Ray actor's threads)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return ProcessPoolExecutor(min(8, os.cpu_count() or 1), mp_context=context, initializer=_end_with_parent)


def _end_with_parent() -> None:
    """A worker ends when the process that started it does, even one killed outright: it would otherwise wait on
    its task queue forever, since it holds that pipe's both ends itself."""
    parent = multiprocessing.parent_process()

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def call_pickled(payload: bytes) -> Any:
    """``fn(**kwargs)`` from a cloudpickled ``(fn, kwargs)``: a function from a user's file travels by value."""
    import cloudpickle

    fn, kwargs = cloudpickle.loads(payload)
    return fn(**kwargs)


def math_equal(response: str, label: object, timeout_s: int = 5) -> bool:
    """Whether the final answer in ``response`` equals ``label`` (a number, or LaTeX with or without $).

    Synchronous and CPU-bound (sympy): from async code call it as ``await asyncio.to_thread(math_equal,
    ...)``. Parsing and comparing each stop after ``timeout_s``: called off the main thread, it grades in
    `grading_pool`, whose workers can set the alarm.
    """
    if threading.current_thread() is not threading.main_thread():
        return grading_pool().submit(math_equal, response, label, timeout_s).result()
    from math_verify import parse, verify  # pulls in sympy and the LaTeX grammar: only when grading

    gold = str(label)
    if "$" not in gold and "\\boxed" not in gold:  # as LaTeX math, so `\frac13` and `(1,2]` parse
        gold = f"${gold}$"
    expected, answer = parse(gold, parsing_timeout=timeout_s), parse(response, parsing_timeout=timeout_s)
    return bool(expected and answer) and verify(expected, answer, timeout_seconds=timeout_s)

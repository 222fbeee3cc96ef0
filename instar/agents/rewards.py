"""Rewards agents call. ``math_equal`` grades a math answer with math-verify: it finds the model's
answer (its ``\\boxed{}``, else its last expression) and compares it with the label symbolically, so
``\\frac{1}{2}``, ``1/2`` and ``0.5`` agree, as do sets, intervals and ``1,000`` and ``1000``.
"""

from __future__ import annotations

import threading


def math_equal(response: str, label: object, timeout_s: int = 5) -> bool:
    """Whether the final answer in ``response`` equals ``label`` (a number, or LaTeX with or without $).

    Synchronous and CPU-bound (sympy): from async code call it as ``await asyncio.to_thread(math_equal,
    ...)``. The ``timeout_s`` guard uses SIGALRM, which only the main thread may set; elsewhere it is off.
    """
    from math_verify import parse, verify  # pulls in sympy and the LaTeX grammar: only when grading

    gold = str(label)
    if "$" not in gold and "\\boxed" not in gold:  # as LaTeX math, so `\frac13` and `(1,2]` parse
        gold = f"${gold}$"
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    expected, answer = parse(gold, parsing_timeout=timeout), parse(response, parsing_timeout=timeout)
    return bool(expected and answer) and verify(expected, answer, timeout_seconds=timeout)

"""instar: agentic reinforcement learning for language models.

``instar.rl``, ``instar.sft`` and ``instar.evaluate`` run the command-line jobs from Python (a script or
a notebook). They are imported on first use, so ``import instar`` stays light.
"""

from instar.version import __version__

__all__ = ["__version__", "evaluate", "rl", "sft"]


def __getattr__(name: str):
    if name in ("rl", "sft", "evaluate"):
        from instar.cli import main

        return getattr(main, name)
    raise AttributeError(f"module 'instar' has no attribute {name!r}")

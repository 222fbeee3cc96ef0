"""Rollout engines behind one token-level protocol, and the session-affinity router."""

from instar.engines.embedded import EmbeddedEngine
from instar.engines.protocol import Engine, EngineLoad, PauseMode
from instar.engines.router import Router
from instar.engines.sampling import LogprobsMode, filter_logits, sample

__all__ = ["EmbeddedEngine", "Engine", "EngineLoad", "LogprobsMode", "PauseMode", "Router", "filter_logits", "sample"]

"""Rollout engines behind one token-level protocol, and the session-affinity router."""

from instar.engines.embedded import EmbeddedEngine
from instar.engines.protocol import Engine, EngineLoad, PauseMode
from instar.engines.router import Router

__all__ = ["EmbeddedEngine", "Engine", "EngineLoad", "PauseMode", "Router"]

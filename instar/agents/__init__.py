"""The agent contract (``Env``, ``ChatAgent`` and their runners), the token-exact transcript, and the
loopback chat server. Agent modules import everything they need from here."""

from instar.agents.api import (
    AgentLoadError,
    ChatAgent,
    ChatAgentRunner,
    ChatContext,
    Env,
    StepEnvRunner,
    Task,
    load_agent,
)
from instar.agents.host import AgentHost
from instar.agents.server import ChatServer, Session
from instar.agents.transcript import Transcript, Turn
from instar.contract import Result, SamplingParams

__all__ = ["AgentHost", "AgentLoadError", "ChatAgent", "ChatAgentRunner", "ChatContext", "ChatServer",
           "Env", "Result", "SamplingParams", "Session", "StepEnvRunner", "Task", "Transcript", "Turn", "load_agent"]

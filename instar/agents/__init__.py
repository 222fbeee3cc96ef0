"""The agent contract (``Env``, ``ChatAgent`` and their runners, ``GymEnvRunner`` for a plain Gymnasium-style
env), the token-exact transcript, and the loopback chat server. Agent modules import everything they need from here."""

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
from instar.agents.gym import GymEnvRunner
from instar.agents.host import AgentHost
from instar.agents.server import ChatServer, Session
from instar.agents.transcript import Transcript, Turn
from instar.contract import Result, SamplingParams

__all__ = ["AgentHost", "AgentLoadError", "ChatAgent", "ChatAgentRunner", "ChatContext", "ChatServer",
           "Env", "GymEnvRunner", "Result", "SamplingParams", "Session", "StepEnvRunner", "Task", "Transcript", "Turn",
           "load_agent"]

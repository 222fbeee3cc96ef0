"""The agent API a researcher writes against, and how an agent module is loaded.

Two forms, same names as Molt's so a Molt agent module runs after changing its import line:

* ``Env`` (Gymnasium style): the framework owns the LLM loop. Each turn it samples an action, calls
  ``step(state)``, and renders the returned observation as the next user turn (a tool turn when
  the action called a tool). ``AgentRunner = StepEnvRunner(MyEnv)``.
* ``ChatAgent``: the agent owns the loop and talks to the policy through the stock OpenAI or
  Anthropic SDK pointed at ``ctx.base_url`` / ``ctx.session_url``. ``AgentRunner = ChatAgentRunner(MyAgent)``.

``AgentRunner`` may also be a runner subclass whose ``__init__`` takes no arguments, as Molt documents it
(``class AgentRunner(ChatAgentRunner): def __init__(self): super().__init__(MyAgent)``); it is
instantiated once. A plain synchronous ``gymnasium.Env`` with text observations and actions runs through
``GymEnvRunner(MyGymEnv)`` (instar/agents/gym.py), an adapter onto the same env loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from instar.config import ConfigError
from instar.contract import Result, SamplingParams
from instar.data.chat import Message
from instar.data.images import text_of, with_images


@dataclass
class Task:
    """One rollout to run: a dataset prompt (a string or chat messages) and where it belongs."""

    prompt: str | list[Message]
    label: Any = None
    tools: list[dict] | None = None
    images: list[Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # the prompt record's other columns
    chat: bool = True  # the record's prompt was chat messages, not a string
    prompt_index: int = -1
    group_id: int = 0
    rollout_id: str = ""
    sampling_params: SamplingParams = field(default_factory=SamplingParams)


class Env:
    """A step environment. ``state`` is a dict with ``observation_text`` (the latest observation: the
    prompt, then each step's observation), ``action_text`` (the model's latest turn as sampled),
    ``label``, ``metadata`` (the prompt record's other columns: test cases, difficulty, id...),
    ``sampling_params``, ``messages`` (the chat so far), ``turn`` (0-based), and, for
    LLM-as-judge rewards, ``untraced_base_url`` / ``untraced_session_url`` / ``api_key`` / ``model_name``."""

    tools: list[dict] | None = None  # tool schemas for the chat template, used when the prompt record has none

    async def reset(self, state: dict) -> dict:
        """Called once before the first turn; may return ``{"observation": text}`` to replace the prompt."""
        return {}

    async def step(self, state: dict) -> Result:
        """Score ``state["action_text"]``; a non-terminated result's observation is the next turn."""
        raise NotImplementedError(f"{type(self).__name__} must define `async def step(self, state) -> Result`")

    async def close(self) -> None:
        """Called once when the rollout ends, however it ends (error and timeout included): free resources."""


@dataclass
class ChatContext:
    """What a ChatAgent gets for one rollout. Calls through ``base_url`` / ``session_url`` are recorded
    token-exactly; calls through the ``untraced_*`` URLs use the same engines and are never trained on."""

    messages: list[Message]
    prompt: str
    label: Any
    tools: list[dict] | None
    images: list[Any] | None
    base_url: str
    session_url: str
    api_key: str
    model_name: str
    session_id: str
    sampling_params: SamplingParams
    max_length: int
    untraced_base_url: str = ""
    untraced_session_url: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)  # the prompt record's other columns (test cases, id...)


class ChatAgent:
    """An agent that runs its own loop against the OpenAI / Anthropic endpoints in ``ctx``. ``run`` may be
    ``async def`` (run on an event loop of its own) or a plain ``def`` (run with no event loop, so helpers
    such as ``Runner.run_sync`` work); either way it runs on a thread of its own, so blocking clients
    (LangChain ``invoke``, ``requests``) are fine. Don't share async clients between rollouts: each
    rollout has its own event loop."""

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError(f"{type(self).__name__} must define `async def run(self, ctx) -> Result` "
                                  f"(or a plain `def run`)")


def _last_user_text(messages: list[Message]) -> str:
    return next((text_of(m["content"]) for m in reversed(messages) if m["role"] == "user"), "")


class StepEnvRunner:
    """Runs an ``Env`` subclass: one new instance per rollout, the LLM loop driven by the framework."""

    def __init__(self, env_class: type[Env]) -> None:
        if not (isinstance(env_class, type) and issubclass(env_class, Env)):
            raise TypeError(f"StepEnvRunner takes an Env subclass (the class, not an instance), got {env_class!r}")
        self.env_class = env_class

    async def rollout(self, task: Task, messages: list[Message], session: Any) -> Result:
        transcript = session.transcript
        tools = task.tools or self.env_class.tools
        state = {"observation_text": _last_user_text(messages), "action_text": "", "label": task.label,
                 "metadata": task.metadata, "sampling_params": task.sampling_params, "messages": messages, "turn": 0,
                 "api_key": session.api_key, "model_name": session.model_name,
                 "untraced_base_url": session.untraced_base_url, "untraced_session_url": session.untraced_session_url}
        env = self.env_class()
        try:
            reset = await env.reset(state) or {}
            observation, images = reset.get("observation"), reset.get("images")
            if observation is not None or images:
                text = text_of(messages[-1]["content"]) if observation is None else observation
                messages = [*messages[:-1], {**messages[-1], "content": with_images(text, images, "reset")}]
                state.update(observation_text=text, messages=messages)
            rewards, score, infos = [], None, []
            while True:
                turn = await transcript.sample(messages, tools, state["sampling_params"])
                if not turn.token_ids:
                    break  # the observation did not fit in --data.max_len: truncated before sampling
                # A copy: an env that edits state["messages"] must not rewrite the transcript's history.
                state.update(action_text=turn.text, messages=copy.deepcopy(transcript.messages), turn=len(infos))
                result = await env.step(state)
                rewards, infos = [*rewards, result.reward], [*infos, result.info]
                score = result.score if result.score is not None else score
                if result.terminated or result.truncated or transcript.truncated:
                    break
                role = "tool" if turn.message.get("tool_calls") else "user"
                content = with_images(result.observation, result.images, f"step {len(infos)} observation")
                messages = [*transcript.messages, {"role": role, "content": content}]
                state.update(observation_text=result.observation,
                             sampling_params=result.sampling_params or state["sampling_params"])
            return Result(reward=sum(rewards), score=score, info={"turns": infos}, turn_rewards=rewards)
        finally:
            await env.close()


class ChatAgentRunner:
    """Runs a ``ChatAgent`` subclass: one new instance per rollout, given a ``ChatContext``."""

    def __init__(self, agent_class: type[ChatAgent]) -> None:
        if not (isinstance(agent_class, type) and issubclass(agent_class, ChatAgent)):
            raise TypeError(f"ChatAgentRunner takes a ChatAgent subclass (the class, not an instance), "
                            f"got {agent_class!r}")
        self.agent_class = agent_class

    async def rollout(self, task: Task, messages: list[Message], session: Any) -> Result:
        ctx = ChatContext(messages=messages, prompt=_last_user_text(messages), label=task.label, tools=task.tools,
                          images=task.images, base_url=session.base_url, session_url=session.session_url,
                          api_key=session.api_key, model_name=session.model_name, session_id=session.id,
                          sampling_params=task.sampling_params, max_length=session.transcript.max_len,
                          untraced_base_url=session.untraced_base_url,
                          untraced_session_url=session.untraced_session_url, metadata=task.metadata)
        result = await on_own_thread(self.agent_class().run, ctx)
        if not isinstance(result, Result):
            raise TypeError(f"{self.agent_class.__name__}.run must return instar.agents.Result, "
                            f"got {type(result).__name__}")
        return result


async def on_own_thread(run: Callable[[ChatContext], Any], ctx: ChatContext) -> Any:
    """``run(ctx)`` on a new thread, awaited here. The caller's loop serves the chat server and the rollout
    timeout, so user code must never block it. An async ``run`` runs under `asyncio.run` there, and
    cancelling the await cancels its task; a blocking call cannot be interrupted, so that thread ends on
    its own (a daemon: it never holds up exit)."""
    inner: concurrent.futures.Future = concurrent.futures.Future()  # an async run's loop and task

    async def main() -> Any:
        inner.set_result((asyncio.get_running_loop(), asyncio.current_task()))
        return await run(ctx)

    result: concurrent.futures.Future = concurrent.futures.Future()

    def call() -> None:
        if result.set_running_or_notify_cancel():  # else timed out before the thread started
            try:
                result.set_result(asyncio.run(main()) if inspect.iscoroutinefunction(run) else run(ctx))
            except BaseException as e:  # handed to the awaiting side, like any outcome
                result.set_exception(e)

    threading.Thread(target=call, name="instar-agent", daemon=True).start()
    try:
        return await asyncio.wrap_future(result)
    except asyncio.CancelledError:
        if inner.done():
            loop, task = inner.result()
            with contextlib.suppress(RuntimeError):  # its loop closed already: nothing left to cancel
                loop.call_soon_threadsafe(task.cancel)
        raise


class AgentLoadError(ConfigError):
    """--train.agent_path does not name a usable agent module; the message says what to fix."""


def import_file(path: str, flag: str) -> Any:
    """The Python file at ``path`` as a module (``flag`` names the option that gave it, for errors)."""
    file = Path(path)
    if not file.is_file():
        raise AgentLoadError(f"{flag} {path!r} is not a file; give the path of a Python file, or package.module:Name")
    name = f"instar_agent_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise AgentLoadError(f"{flag} {path!r} cannot be imported as a Python module (use a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # other processes cannot import it by name
    return module


def import_named(spec: str, flag: str, default: str = "") -> tuple[Any, str]:
    """The module ``spec`` names and the attribute to take from it: ``path/to/file.py`` (attribute ``default``),
    ``path/to/file.py:Name``, or ``package.module:Name`` (an installed package, or one on PYTHONPATH)."""
    where, _, attr = spec.rpartition(":") if ":" in spec else (spec, "", default)
    if where.endswith(".py") or Path(where).is_file() or not attr:
        return import_file(where, flag), attr
    try:
        return importlib.import_module(where), attr
    except ModuleNotFoundError as e:
        raise AgentLoadError(f"{flag} {spec!r}: cannot import {where!r} ({e}); install its package or put its "
                             "directory on PYTHONPATH") from None


def load_agent(path: str) -> StepEnvRunner | ChatAgentRunner:
    """The runner ``path`` names (see `import_named`; a file's runner is its ``AgentRunner``)."""
    module, attr = import_named(path, "--train.agent_path", "AgentRunner")
    runner = getattr(module, attr, None)
    if runner is None:
        raise AgentLoadError(f"{path} defines no {attr}; add `{attr} = StepEnvRunner(YourEnv)` or "
                             f"`{attr} = ChatAgentRunner(YourChatAgent)`")
    runners = (StepEnvRunner, ChatAgentRunner)  # GymEnvRunner is a StepEnvRunner
    if isinstance(runner, type) and issubclass(runner, runners):  # Molt's form: a subclass, built here
        try:
            inspect.signature(runner).bind()
        except TypeError as e:
            raise AgentLoadError(f"{path}: AgentRunner class {runner.__name__} cannot be built without arguments "
                                 f"({e}); give it `def __init__(self): super().__init__(YourClass)` or set "
                                 f"`AgentRunner = {runner.__name__}(YourClass)`") from None
        runner = runner()
    if not isinstance(runner, runners):
        raise AgentLoadError(f"{path}: AgentRunner must be StepEnvRunner(YourEnv), ChatAgentRunner(YourChatAgent), "
                             f"GymEnvRunner(YourGymEnv) or such a runner subclass whose __init__ takes no arguments, "
                             f"got {runner!r} of type {type(runner).__name__}")
    return runner

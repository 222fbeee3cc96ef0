"""Molt's agent-file forms (the runner as a subclass) and a plain gymnasium.Env through GymEnvRunner:
each loads with load_agent and records real trajectories through the agent host, the chat server and
the embedded engine running the scripted tiny model (helpers/agents.py)."""

import threading
from pathlib import Path

import numpy as np
import pytest
from helpers.agents import GREEDY, USER, hosting, task

from instar.agents import (
    AgentLoadError,
    ChatAgentRunner,
    GymEnvRunner,
    StepEnvRunner,
    load_agent,
)
from instar.data.chat import encode, prompt_ids, render

AGENTS = Path(__file__).resolve().parent / "agents"
ANSWER = {"role": "assistant", "content": "The answer is 5."}
CHECKED = {"role": "assistant", "content": "It is correct."}


def two_turn_ids(tok) -> list[int]:
    """The prompt, "The answer is 5.", "Check it.", "It is correct.": what the scripted model replays."""
    messages = [USER, ANSWER, {"role": "user", "content": "Check it."}, CHECKED]
    return encode(tok, render(tok, messages, generation_prompt=False).removesuffix("\n"))


def label_gym_env() -> type:
    """tests/agents/gym_env.py's env class, as the adapter that load_agent built holds it."""
    return load_agent(str(AGENTS / "gym_env.py")).env_class.gym_class


def load_error(tmp_path, body: str) -> str:
    file = tmp_path / "bad_agent.py"
    file.write_text("from instar.agents import *\n" + body)
    with pytest.raises((AgentLoadError, TypeError)) as caught:
        load_agent(str(file))
    return str(caught.value).replace(str(file), "FILE")


def test_bad_runner_forms_still_say_what_to_fix(tmp_path):
    assert load_error(tmp_path, "AgentRunner = StepEnvRunner\n") == (
        "FILE: AgentRunner class StepEnvRunner cannot be built without arguments (missing a required argument: "
        "'env_class'); give it `def __init__(self): super().__init__(YourClass)` or set "
        "`AgentRunner = StepEnvRunner(YourClass)`")
    assert load_error(tmp_path, "class AgentRunner(ChatAgentRunner):\n    def __init__(self, agent): pass\n") == (
        "FILE: AgentRunner class AgentRunner cannot be built without arguments (missing a required argument: "
        "'agent'); give it `def __init__(self): super().__init__(YourClass)` or set "
        "`AgentRunner = AgentRunner(YourClass)`")
    assert load_error(tmp_path, "class E(Env): pass\nAgentRunner = E\n") == (
        "FILE: AgentRunner must be StepEnvRunner(YourEnv), ChatAgentRunner(YourChatAgent), GymEnvRunner(YourGymEnv) "
        "or such a runner subclass whose __init__ takes no arguments, got <class 'instar_agent_bad_agent.E'> of "
        "type type")
    # The runner's own check still names the mix-up when a subclass passes the wrong kind of class.
    assert load_error(tmp_path, "class E(Env): pass\nclass AgentRunner(ChatAgentRunner):\n"
                                "    def __init__(self):\n        super().__init__(E)\n") == (
        "ChatAgentRunner takes a ChatAgent subclass (the class, not an instance), "
        "got <class 'instar_agent_bad_agent.E'>")
    with pytest.raises(TypeError, match=r"GymEnvRunner takes a class with reset\(seed=, options=\), step\(action\) "
                                        r"and close\(\) \(e.g. a gymnasium.Env subclass; the class, not an instance\), "
                                        r"got <object object"):
        GymEnvRunner(object())
    with pytest.raises(TypeError, match="GymEnvRunner takes a class .* got <class 'str'>"):
        GymEnvRunner(str)  # no reset / step / close


@pytest.mark.asyncio
@pytest.mark.parametrize("agent, info", [("molt_openai_agent.py", {"finish_reason": "stop"}),
                                         ("molt_anthropic_agent.py", {"stop_reason": "end_turn"})])
async def test_molt_chat_agents_run_with_only_the_import_line_changed(scripted, agent, info):
    runner = load_agent(str(AGENTS / agent))
    assert type(runner).__name__ == "AgentRunner" and isinstance(runner, ChatAgentRunner)
    tok = scripted.tokenizer
    async with hosting(scripted, runner) as (host, engine):
        found, missed = await host.rollout(task("5")), await host.rollout(task("7"))
    assert (found.reward, found.score, found.info, found.finish_reason) == (1.0, 1.0, info, "stop")
    assert (missed.reward, missed.score, len(engine.calls)) == (0.0, 0.0, 2)
    [seg] = found.segments
    prompt, answer = prompt_ids(tok, [USER]), encode(tok, "The answer is 5.") + [tok.eos_token_id]
    assert (seg.token_ids, seg.action_mask) == (prompt + answer, [0] * len(prompt) + [1] * len(answer))


@pytest.mark.asyncio
async def test_molt_env_subclass_runs_the_env_loop(scripted):
    runner = load_agent(str(AGENTS / "molt_env.py"))
    assert type(runner).__name__ == "AgentRunner" and isinstance(runner, StepEnvRunner)
    async with hosting(scripted, runner) as (host, engine):
        traj, both = await host.rollout(task("5")), await host.rollout(task("is"))
    # "5" is in the first answer only; "is" in both: the turn rewards are summed, the score is the last turn's.
    assert (traj.reward, traj.score, traj.info) == (1.0, 0.0, {"turns": [{"found": 1.0}, {"found": 0.0}]})
    assert (both.reward, both.score, len(engine.calls)) == (2.0, 1.0, 4)
    [seg] = traj.segments
    tok = scripted.tokenizer
    sampled = len(encode(tok, ANSWER["content"])) + len(encode(tok, CHECKED["content"])) + 2  # + end-of-turn ids
    assert seg.token_ids == two_turn_ids(tok) and sum(seg.action_mask) == sampled


class Probe:
    """Wraps tests/agents/gym_env.py's env: records what it is given, on which thread, and closes."""

    calls: list = []

    @classmethod
    def of(cls, env_class, first_observation="keep"):
        class Probed(env_class):
            def reset(self, *, seed=None, options=None):
                obs, info = super().reset(seed=seed, options=options)
                cls.calls.append(("reset", seed, options, threading.current_thread() is threading.main_thread()))
                return (obs if first_observation == "keep" else first_observation), info

            def step(self, action):
                cls.calls.append(("step", action, threading.current_thread() is threading.main_thread()))
                return super().step(action)

            def close(self):
                cls.calls.append(("close",))

        return Probed


@pytest.mark.asyncio
async def test_gym_env_runs_off_the_event_loop_and_records_what_the_env_form_records(scripted):
    gym_env = load_agent(str(AGENTS / "gym_env.py"))
    assert isinstance(gym_env, GymEnvRunner)
    Probe.calls = []
    async with hosting(scripted, GymEnvRunner(Probe.of(label_gym_env()))) as (host, engine):
        traj = await host.rollout(task("is"))
    assert (traj.reward, traj.score, traj.info, traj.finish_reason) == (2.0, None, {"turns": [{"step": 1},
                                                                                              {"step": 2}]}, "stop")
    # Every env call ran in a worker thread (False: not the event loop's thread), then close, once.
    assert Probe.calls == [("reset", None, {"prompt": "What is 2+3?", "label": "is"}, False),
                           ("step", "The answer is 5.", False), ("step", "It is correct.", False), ("close",)]
    [seg] = traj.segments
    assert seg.token_ids == two_turn_ids(scripted.tokenizer) and len(engine.calls) == 2
    async with hosting(scripted, gym_env) as (host, _):
        assert (await host.rollout(task("5"))).reward == 1.0  # the agent file itself, unwrapped


@pytest.mark.asyncio
@pytest.mark.parametrize("prompt, first_observation", [("What is 2+3?", None), ("What is 2+3?", ""),
                                                       ("placeholder", "What is 2+3?")])
async def test_gym_reset_observation_replaces_the_prompt_unless_empty(scripted, prompt, first_observation):
    class OneStep(label_gym_env()):
        def step(self, action):
            obs, reward, _, _, info = super().step(action)
            return None, np.float32(reward), np.bool_(True), False, info  # terminated: no next observation

    Probe.calls = []
    async with hosting(scripted, GymEnvRunner(Probe.of(OneStep, first_observation))) as (host, engine):
        traj = await host.rollout(task("5", prompt=prompt))
    assert (traj.reward, traj.info, len(engine.calls)) == (1.0, {"turns": [{"step": 1}]}, 1)
    assert Probe.calls[0][2] == {"prompt": prompt, "label": "5"}
    tok = scripted.tokenizer
    assert traj.segments[0].token_ids == prompt_ids(tok, [USER]) + encode(tok, "The answer is 5.") + [tok.eos_token_id]


@pytest.mark.asyncio
async def test_gym_env_with_a_non_text_observation_is_a_clear_error_and_still_closes(scripted):
    class ArrayObservation(label_gym_env()):
        def step(self, action):
            return np.zeros(3), 0.0, False, False, {}

    Probe.calls = []
    runner = GymEnvRunner(Probe.of(ArrayObservation))
    async with hosting(scripted, runner) as (host, _):
        with pytest.raises(TypeError) as caught:
            await runner.rollout(task(), [USER], host.server.open(GREEDY))
        assert await host.rollout(task()) is None
    assert str(caught.value) == ("Probed.step must return a text (str) observation for GymEnvRunner, got ndarray; "
                                 "render the observation as text")
    assert host.metrics() == {"agent/finished": 0.0, "agent/dropped_error_TypeError": 1.0}
    assert [c[0] for c in Probe.calls] == ["reset", "step", "close"] * 2

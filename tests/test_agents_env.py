"""Agent loading, the env loop, the host's drop accounting and every example agent, end to end on the
embedded engine with the scripted tiny model (helpers/agents.py)."""

import asyncio
from pathlib import Path

import pytest
import torch
from helpers.agents import GREEDY, USER, hosting, task, tool_conversation_ids

from instar.agents import AgentLoadError, ChatAgent, ChatAgentRunner, Env, Result, StepEnvRunner, load_agent
from instar.data.chat import encode, prompt_ids, render

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"


def test_load_agent_says_what_is_wrong(tmp_path):
    with pytest.raises(AgentLoadError, match="is not a file"):
        load_agent(str(tmp_path / "missing.py"))
    (tmp_path / "none.py").write_text("from instar.agents import Env\n")
    with pytest.raises(AgentLoadError, match="defines no AgentRunner; add `AgentRunner = StepEnvRunner"):
        load_agent(str(tmp_path / "none.py"))
    (tmp_path / "wrong.py").write_text("from instar.agents import Env\nclass E(Env): pass\nAgentRunner = E\n")
    with pytest.raises(AgentLoadError, match="AgentRunner must be StepEnvRunner.*got <class .*E'> of type type"):
        load_agent(str(tmp_path / "wrong.py"))
    with pytest.raises(TypeError, match="StepEnvRunner takes an Env subclass"):
        StepEnvRunner(ChatAgent)
    with pytest.raises(TypeError, match="ChatAgentRunner takes a ChatAgent subclass"):
        ChatAgentRunner(Env())
    assert isinstance(load_agent(str(EXAMPLES / "math_env.py")), StepEnvRunner)


@pytest.mark.asyncio
async def test_math_env_example_scores_a_single_turn(scripted):
    tok = scripted.tokenizer
    async with hosting(scripted, load_agent(str(EXAMPLES / "math_env.py"))) as (host, _):
        right, wrong = await host.rollout(task("5")), await host.rollout(task("6"))
    assert (right.reward, right.score, right.info, right.finish_reason) == (1.0, 1.0, {"turns": [{"boxed": False}]},
                                                                            "stop")
    assert (wrong.reward, right.rollout_id, right.prompt_index, right.group_id) == (0.0, "r0", 7, 3)
    [seg] = right.segments
    answer = encode(tok, "The answer is 5.") + [tok.eos_token_id]
    assert seg.token_ids == prompt_ids(tok, [USER]) + answer
    assert seg.action_mask == [0] * len(prompt_ids(tok, [USER])) + [1] * len(answer)


@pytest.mark.asyncio
@pytest.mark.parametrize("example, info", [("calculator_env.py", {"turns": [{"tool": "2+3"}, {"tool": None}]}),
                                           ("openai_tool_agent.py", {"tool_calls": 1}),
                                           ("anthropic_agent.py", {"turns": 4}),
                                           ("langchain_agent.py", {"tool_calls": 1}),
                                           ("openai_agents_sdk_agent.py", {"tool_calls": 1})])
async def test_calculator_examples_record_the_same_tokens_in_every_agent_form(scripted, example, info):
    runner = load_agent(str(EXAMPLES / example))
    async with hosting(scripted, runner) as (host, engine):
        traj = await host.rollout(task("5"))
    assert (traj.reward, traj.score, traj.info, traj.finish_reason) == (1.0, 1.0, info, "stop")
    [seg] = traj.segments
    assert (seg.token_ids, seg.action_mask) == tool_conversation_ids(scripted.tokenizer)
    sampled = [x for x, m in zip(seg.rollout_logprobs, seg.action_mask) if m]
    assert sampled == [x for _, gen, _ in engine.calls for x in gen.logprobs]


@pytest.mark.asyncio
async def test_judge_example_rewards_through_the_untraced_endpoint_only(scripted):
    tok = scripted.tokenizer
    async with hosting(scripted, load_agent(str(EXAMPLES / "judge_env.py"))) as (host, engine):
        traj = await host.rollout(task())
    assert (traj.reward, traj.info) == (1.0, {"turns": [{"verdict": "correct"}]})
    [seg] = traj.segments
    assert seg.token_ids == prompt_ids(tok, [USER]) + encode(tok, "The answer is 5.") + [tok.eos_token_id]
    assert [sid.endswith("/untraced") for _, _, sid in engine.calls] == [False, True]


class Scripted(Env):
    """Sees two turns, checks the state it is given, changes sampling for the second turn."""

    seen: list = []

    async def reset(self, state):
        return {"observation": "What is 2+3?"}  # replaces the placeholder prompt

    async def step(self, state):
        Scripted.seen.append({k: state[k] for k in ("observation_text", "action_text", "label", "turn")})
        if state["turn"] == 0:
            return Result(reward=0.5, observation="Check it.", terminated=False, info={"k": 1},
                          sampling_params=state["sampling_params"].replace(max_tokens=7))
        return Result(reward=torch.tensor(0.25), score=torch.tensor(1.0), info={"k": torch.tensor(2.0)})


@pytest.mark.asyncio
async def test_env_loop_sums_rewards_keeps_turn_info_and_applies_step_sampling(scripted):
    tok = scripted.tokenizer
    async with hosting(scripted, StepEnvRunner(Scripted)) as (host, engine):
        traj = await host.rollout(task("5", prompt="placeholder"))
    assert Scripted.seen == [
        {"observation_text": "What is 2+3?", "action_text": "The answer is 5.", "label": "5", "turn": 0},
        {"observation_text": "Check it.", "action_text": "It is correct.", "label": "5", "turn": 1}]
    assert (traj.reward, traj.score, traj.info) == (0.75, 1.0, {"turns": [{"k": 1}, {"k": 2.0}]})
    assert [p.max_tokens for p in engine.params] == [64, 7]
    messages = [USER, {"role": "assistant", "content": "The answer is 5."}, {"role": "user", "content": "Check it."},
                {"role": "assistant", "content": "It is correct."}]
    assert tok.decode(traj.segments[0].token_ids) == render(tok, messages, generation_prompt=False).removesuffix("\n")


class Forever(Env):
    async def step(self, state):
        return Result(observation="Check it.", terminated=False)


@pytest.mark.asyncio
async def test_token_budgets_truncate_the_rollout(scripted):
    tok = scripted.tokenizer
    async with hosting(scripted, StepEnvRunner(Forever), max_new_tokens=3) as (host, engine):
        cut = await host.rollout(task())
    assert cut.finish_reason == "length" and len(engine.calls) == 1 and len(engine.calls[0][1].token_ids) == 3
    first_turn = len(prompt_ids(tok, [USER])) + len(encode(tok, "The answer is 5.")) + 1
    async with hosting(scripted, StepEnvRunner(Forever), max_len=first_turn + 5) as (host, engine):
        full = await host.rollout(task())  # the observation does not fit after the first turn
    assert full.finish_reason == "length" and len(engine.calls) == 1 and len(full.segments[0].token_ids) == first_turn


class Broken(Env):
    async def step(self, state):
        raise ValueError("bad action")


class Slow(Env):
    async def step(self, state):
        await asyncio.sleep(60)


class TakesASecond(Env):
    async def step(self, state):
        await asyncio.sleep(1.0)
        return Result(reward=1.0)


class RaisesAtOnce(ChatAgent):
    async def run(self, ctx):
        raise KeyError("before any call")


class Silent(ChatAgent):
    contexts: list = []

    async def run(self, ctx):
        Silent.contexts.append(ctx)
        return Result(reward=1.0)  # never calls the model: nothing to train on


@pytest.mark.asyncio
async def test_failing_agents_are_dropped_and_counted_and_the_run_goes_on(scripted):
    async with hosting(scripted, StepEnvRunner(Broken), agent_timeout=1.0, system_prompt="Be brief.") as (host, _):
        assert await host.rollout(task()) is None
        host.runner = StepEnvRunner(Slow)
        assert await host.rollout(task()) is None
        host.runner = ChatAgentRunner(Silent)
        assert await host.rollout(task()) is None
        host.runner = load_agent(str(EXAMPLES / "math_env.py"))
        assert (await host.rollout(task())).segments
        assert host.server.sessions == {}
    assert host.metrics() == {"agent/finished": 1.0, "agent/dropped_error_ValueError": 1.0,
                              "agent/dropped_timeout": 1.0, "agent/dropped_invalid": 1.0}
    [ctx] = Silent.contexts
    assert ctx.messages == [{"role": "system", "content": "Be brief."}, USER] and ctx.prompt == "What is 2+3?"
    assert (ctx.label, ctx.model_name, ctx.max_length, ctx.sampling_params) == ("5", "tiny", 1024, GREEDY)
    assert ctx.base_url == f"{host.server.root}/s/{ctx.session_id}/v1"
    assert ctx.untraced_base_url == f"{host.server.root}/u/{ctx.session_id}/v1"
    assert ctx.session_url == f"{host.server.root}/s/{ctx.session_id}" and len(ctx.api_key) >= 32


@pytest.mark.asyncio
async def test_on_agent_error_keep_trains_what_was_sampled_with_the_given_reward(scripted):
    """--train.on_agent_error keep: a framework that raises after sampling (a turn cut by the token limit) keeps
    its rollout at --train.agent_error_reward; the error is counted, and still dropped with nothing sampled."""
    async with hosting(scripted, StepEnvRunner(Broken)) as (host, _):
        host.error_reward = -1.0
        traj = await host.rollout(task())
        host.runner = ChatAgentRunner(Silent)
        assert await host.rollout(task()) is None  # nothing sampled at all
        host.runner = ChatAgentRunner(RaisesAtOnce)
        assert await host.rollout(task()) is None  # raised before sampling: dropped, and not counted as kept
    assert (traj.reward, traj.info, traj.turns) == (-1.0, {"error": "ValueError: bad action"}, 1)
    [seg] = traj.segments
    assert sum(seg.action_mask) == len(encode(scripted.tokenizer, "The answer is 5.")) + 1
    assert host.metrics() == {"agent/finished": 1.0, "agent/dropped_invalid": 2.0, "agent/kept_error_ValueError": 1.0}


@pytest.mark.asyncio
async def test_time_the_engines_hold_requests_for_a_weight_sync_is_not_the_agents(scripted):
    """--train.agent_timeout stops while the engines hold requests behind a weight sync (`AgentHost.hold`, told by
    the driver): a rollout that ran 1 s, 0.8 s of it held, is within 0.5 s; the same without the hold is not."""
    async with hosting(scripted, StepEnvRunner(TakesASecond), agent_timeout=0.5) as (host, _):
        assert await host.rollout(task()) is None
        rollout = asyncio.ensure_future(host.rollout(task()))
        await asyncio.sleep(0.1)
        host.hold(True)
        await asyncio.sleep(0.8)
        host.hold(False)
        assert (await rollout).reward == 1.0
    assert host.metrics() == {"agent/finished": 1.0, "agent/dropped_timeout": 1.0}
    assert 0.75 < host.held_s < 1.5

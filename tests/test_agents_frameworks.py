"""Agent frameworks run unchanged inside a ChatAgent, through the real chat server on the scripted tiny
model: LangChain (async and blocking), the OpenAI Agents SDK (Chat Completions and Responses models,
``Runner.run`` and ``Runner.run_sync``). Each must record the one token sequence of the calculator task."""

import asyncio
import gc
import json
import logging
import threading
import time

import pytest
from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, set_tracing_disabled
from helpers.agents import CALCULATOR, CALCULATOR_ANTHROPIC, ScriptedEngine, hosting, task, tool_conversation_ids
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import ToolMessage
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from instar.agents import AgentHost, ChatAgent, ChatAgentRunner, Result

set_tracing_disabled(True)
RELEASE = threading.Event()  # lets the hung agents' threads end once a test is done with them


def answer(text: str) -> Result:
    correct = float(text.strip().endswith("5."))
    return Result(reward=correct, score=correct)




class LangChainBlockingInAsync(ChatAgent):
    """A blocking client called from ``async def run``: the event loop it blocks is the agent's own."""

    async def run(self, ctx):
        model = ChatOpenAI(model="tiny", base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0).bind_tools(
            [CALCULATOR])
        messages = [("user", ctx.prompt)]
        reply = model.invoke(messages)
        messages += [reply, ToolMessage("5", tool_call_id=reply.tool_calls[0]["id"])]
        return answer(model.invoke(messages).text)


class LangChainAsync(ChatAgent):
    async def run(self, ctx):
        model = ChatOpenAI(model="tiny", base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0).bind_tools(
            [CALCULATOR])
        messages = [("user", ctx.prompt)]
        reply = await model.ainvoke(messages)
        messages += [reply, ToolMessage("5", tool_call_id=reply.tool_calls[0]["id"])]
        return answer((await model.ainvoke(messages)).text)


class LangChainAnthropicBlocking(ChatAgent):
    def run(self, ctx):
        model = ChatAnthropic(model="tiny", base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0,
                              max_tokens=64).bind_tools([CALCULATOR_ANTHROPIC])
        messages = [("user", ctx.prompt)]
        reply = model.invoke(messages)
        messages += [reply, ToolMessage("5", tool_call_id=reply.tool_calls[0]["id"])]
        return answer(model.invoke(messages).text)


def calculator_tool(calls: list) -> FunctionTool:
    async def invoke(_context, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return "5"

    return FunctionTool(name="calculator", description=CALCULATOR["function"]["description"],
                        params_json_schema=CALCULATOR["function"]["parameters"], on_invoke_tool=invoke,
                        strict_json_schema=False)


class AgentsSdkChatCompletions(ChatAgent):
    async def run(self, ctx):
        calls = []
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        agent = Agent(name="calc", model=OpenAIChatCompletionsModel("tiny", client), tools=[calculator_tool(calls)])
        result = await Runner.run(agent, ctx.prompt, max_turns=4)
        return answer(result.final_output) if calls == [{"expression": "2+3"}] else Result(reward=0.0)


class AgentsSdkResponsesRunSync(ChatAgent):
    def run(self, ctx):  # no event loop on this thread: run_sync may start its own
        calls = []
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        agent = Agent(name="calc", model=OpenAIResponsesModel("tiny", client), tools=[calculator_tool(calls)])
        result = Runner.run_sync(agent, ctx.prompt, max_turns=4)
        return answer(result.final_output) if calls == [{"expression": "2+3"}] else Result(reward=0.0)


class AgentsSdkResponsesStreamed(ChatAgent):
    async def run(self, ctx):
        calls = []
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        agent = Agent(name="calc", model=OpenAIResponsesModel("tiny", client), tools=[calculator_tool(calls)])
        result = Runner.run_streamed(agent, ctx.prompt, max_turns=4)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds
        return answer(result.final_output) if calls == [{"expression": "2+3"}] else Result(reward=0.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("agent", [LangChainBlockingInAsync, LangChainAsync, LangChainAnthropicBlocking,
                                   AgentsSdkChatCompletions, AgentsSdkResponsesRunSync, AgentsSdkResponsesStreamed])
async def test_frameworks_record_the_calculator_conversation_token_exactly(scripted, agent):
    async with hosting(scripted, ChatAgentRunner(agent)) as (host, engine):
        traj = await host.rollout(task("5"))
    assert host.metrics() == {"agent/finished": 1.0}
    assert (traj.reward, traj.finish_reason) == (1.0, "stop")
    [seg] = traj.segments
    assert (seg.token_ids, seg.action_mask) == tool_conversation_ids(scripted.tokenizer)
    assert [x for x, m in zip(seg.rollout_logprobs, seg.action_mask) if m] == [
        x for _, gen, _ in engine.calls for x in gen.logprobs]


class BlocksItsLoop(ChatAgent):
    async def run(self, ctx):
        RELEASE.wait(30)  # a hung blocking call inside async def run
        return Result(reward=1.0)


class HangsInDef(ChatAgent):
    def run(self, ctx):
        RELEASE.wait(30)
        return Result(reward=1.0)


class AwaitsForever(ChatAgent):
    cancelled = threading.Event()

    async def run(self, ctx):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            AwaitsForever.cancelled.set()
            raise


@pytest.mark.asyncio
async def test_hung_agents_time_out_in_every_form_and_the_host_goes_on(scripted):
    try:
        async with hosting(scripted, ChatAgentRunner(BlocksItsLoop), agent_timeout=0.5) as (host, _):
            for agent in (BlocksItsLoop, HangsInDef, AwaitsForever):
                host.runner = ChatAgentRunner(agent)
                start = time.perf_counter()
                assert await host.rollout(task()) is None
                assert time.perf_counter() - start < 2
            assert AwaitsForever.cancelled.wait(5)  # its task was cancelled on its own loop
            host.runner, host.agent_timeout = ChatAgentRunner(LangChainAsync), 30
            assert (await host.rollout(task("5"))).reward == 1.0
    finally:
        RELEASE.set()
    assert host.metrics() == {"agent/finished": 1.0, "agent/dropped_timeout": 3.0}


class AsksAndWaits(ChatAgent):
    async def run(self, ctx):
        # closed as it is cancelled: a client left to the garbage collector schedules its own close on the loop,
        # which may be closed by then (asyncio then logs "Task exception was never retrieved", the agent's noise)
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            await client.chat.completions.create(model="tiny", messages=ctx.messages)
        return Result(reward=1.0)


@pytest.fixture
def earlier_clients_collected():
    """An SDK client that an earlier test left open closes itself when collected, by scheduling its close on the
    running loop; collected during this test, that close fails on its own (closed) loop and asyncio logs it
    here. Collected now, outside any loop, it schedules nothing."""
    gc.collect()


@pytest.mark.asyncio
async def test_shutdown_cancels_rollouts_in_flight_quietly(tiny_model_dir, caplog, earlier_clients_collected):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tok)
    engine.hang = True  # every turn is still being sampled when the run ends
    logging.getLogger("uvicorn.error").addHandler(caplog.handler)
    try:
        async with AgentHost(ChatAgentRunner(AsksAndWaits), engine, tok, max_len=512, max_new_tokens=8,
                             agent_timeout=30) as host:
            rollouts = [asyncio.ensure_future(host.rollout(task())) for _ in range(3)]
            while len(engine.prompts) < 3:
                await asyncio.sleep(0.01)
        assert [await r for r in rollouts] == [None] * 3
    finally:
        logging.getLogger("uvicorn.error").removeHandler(caplog.handler)
    assert host.metrics() == {"agent/finished": 0.0, "agent/cancelled": 3.0}
    assert engine.cancelled.is_set()  # the engine requests were cancelled with them
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


class AgentsSdkUnguarded(ChatAgent):
    """The OpenAI Agents SDK as most users write it: nothing catches the ModelBehaviorError it raises when a turn
    ends "incomplete" (cut at --data.max_new_tokens)."""

    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        try:
            result = await Runner.run(Agent(name="calc", model=OpenAIResponsesModel("tiny", client)), ctx.prompt)
        finally:
            await client.close()
        return answer(result.final_output)


@pytest.mark.asyncio
async def test_on_agent_error_keep_trains_the_turn_the_agents_sdk_rejects(scripted):
    async with hosting(scripted, ChatAgentRunner(AgentsSdkUnguarded), max_new_tokens=3) as (host, _):
        assert await host.rollout(task("5")) is None  # --train.on_agent_error drop: the rollout is lost
        host.error_reward = 0.0  # keep
        traj = await host.rollout(task("5"))
    assert (traj.reward, traj.finish_reason, traj.turns) == (0.0, "length", 1)
    assert traj.info["error"].startswith("ModelBehaviorError") and sum(traj.segments[0].action_mask) == 3
    assert host.metrics() == {"agent/finished": 1.0, "agent/dropped_error_ModelBehaviorError": 1.0,
                              "agent/kept_error_ModelBehaviorError": 1.0}

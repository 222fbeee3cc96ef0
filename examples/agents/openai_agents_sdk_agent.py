"""A ChatAgent on the OpenAI Agents SDK with its default model class (the Responses API) and one tool.

The SDK runs unchanged: ``Runner.run`` against ctx.base_url, whose ``/v1/responses`` records the same
token-exact transcript as the Chat Completions route. (A plain ``def run`` may call ``Runner.run_sync``.)"""

import json
import re

from agents import Agent, FunctionTool, ModelBehaviorError, RunConfig, Runner, set_tracing_disabled
from agents.models.openai_provider import OpenAIProvider
from openai import AsyncOpenAI

from instar.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI with ctx.api_key

PARAMETERS = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}


def calculate(expression: str) -> str:
    if not re.fullmatch(r"[\d+\-* ()]+", expression):
        return "error: use integers with + - *"
    return str(eval(expression, {"__builtins__": {}}))  # digits and + - * ( ) only


class AgentsSdkCalculatorAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        calls: list[str] = []

        async def calculator(_context, arguments: str) -> str:
            calls.append(json.loads(arguments).get("expression", ""))
            return calculate(calls[-1])

        tool = FunctionTool(name="calculator", description="Evaluate an arithmetic expression with + - * and "
                            "integers.", params_json_schema=PARAMETERS, on_invoke_tool=calculator,
                            strict_json_schema=False)
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        agent = Agent(name="calculator", model=ctx.model_name, tools=[tool])
        try:
            result = await Runner.run(agent, ctx.messages, max_turns=4,
                                      run_config=RunConfig(model_provider=OpenAIProvider(openai_client=client)))
        except ModelBehaviorError:  # a turn cut at --data.max_new_tokens is "incomplete", and the SDK raises:
            return Result(reward=0.0, score=0.0, info={"tool_calls": len(calls)})  # score it, keep the tokens
        finally:
            await client.close()
        numbers = re.findall(r"-?\d+", str(result.final_output))
        correct = bool(numbers) and numbers[-1] == str(ctx.label)
        return Result(reward=float(correct), score=float(correct), info={"tool_calls": len(calls)})


AgentRunner = ChatAgentRunner(AgentsSdkCalculatorAgent)

"""A ChatAgent that owns its loop and talks to the policy through the stock OpenAI SDK, with tools.
Every call through ctx.base_url is recorded token-exactly; tool results go back as `tool` messages."""

import json
import re

from openai import AsyncOpenAI

from instar.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * and integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calculate(expression: str) -> str:
    if not re.fullmatch(r"[\d+\-* ()]+", expression):
        return "error: use integers with + - *"
    return str(eval(expression, {"__builtins__": {}}))  # digits and + - * ( ) only


class CalculatorAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages, tool_calls = list(ctx.messages), 0
        for _ in range(4):
            reply = await client.chat.completions.create(
                model=ctx.model_name, messages=messages, tools=[CALCULATOR], max_tokens=64)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))  # echo the turn back unchanged
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments).get("expression", "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
                tool_calls += 1
        await client.close()
        numbers = re.findall(r"-?\d+", message.content or "")
        correct = bool(numbers) and numbers[-1] == str(ctx.label)
        return Result(reward=float(correct), score=float(correct), info={"tool_calls": tool_calls})


AgentRunner = ChatAgentRunner(CalculatorAgent)

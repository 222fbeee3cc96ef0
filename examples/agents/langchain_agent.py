"""A ChatAgent on LangChain: ``ChatOpenAI`` with a bound tool, driven by its synchronous ``invoke``.

``run`` is a plain ``def``: instar runs it on a thread of its own, so blocking clients are fine (an
``async def run`` would use ``ainvoke``). Every call through ctx.base_url is recorded token-exactly."""

import re

from langchain_core.messages import ToolMessage
from langchain_openai import ChatOpenAI

from instar.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * and integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calculate(expression: str) -> str:
    if not re.fullmatch(r"[\d+\-* ()]+", expression):
        return "error: use integers with + - *"
    return str(eval(expression, {"__builtins__": {}}))  # digits and + - * ( ) only


class LangChainCalculatorAgent(ChatAgent):
    def run(self, ctx: ChatContext) -> Result:
        model = ChatOpenAI(model=ctx.model_name, base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                           max_tokens=64).bind_tools([CALCULATOR])
        messages: list = [(m["role"], m["content"]) for m in ctx.messages]
        tool_calls = 0
        for _ in range(4):
            reply = model.invoke(messages)
            messages.append(reply)  # LangChain sends the turn back in its own serialisation
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                messages.append(ToolMessage(calculate(call["args"].get("expression", "")), tool_call_id=call["id"]))
                tool_calls += 1
        numbers = re.findall(r"-?\d+", reply.text)
        correct = bool(numbers) and numbers[-1] == str(ctx.label)
        return Result(reward=float(correct), score=float(correct), info={"tool_calls": tool_calls})


AgentRunner = ChatAgentRunner(LangChainCalculatorAgent)

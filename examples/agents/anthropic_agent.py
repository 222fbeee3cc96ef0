"""A ChatAgent on the stock Anthropic SDK: tool_use / tool_result blocks over ctx.session_url.
The server records the same token-exact transcript as for the OpenAI protocol."""

import re

from anthropic import AsyncAnthropic

from instar.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

CALCULATOR = {"name": "calculator", "description": "Evaluate an arithmetic expression with + - * and integers.",
              "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                               "required": ["expression"]}}


def calculate(expression: str) -> str:
    if not re.fullmatch(r"[\d+\-* ()]+", expression):
        return "error: use integers with + - *"
    return str(eval(expression, {"__builtins__": {}}))  # digits and + - * ( ) only


class AnthropicCalculatorAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        system = "\n".join(m["content"] for m in ctx.messages if m["role"] == "system") or None
        messages = [m for m in ctx.messages if m["role"] != "system"]
        kwargs = {"system": system} if system else {}
        for _ in range(4):
            reply = await client.messages.create(model=ctx.model_name, max_tokens=64, messages=messages,
                                                 tools=[CALCULATOR], **kwargs)
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if reply.stop_reason != "tool_use" or not uses:
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": calculate(b.input.get("expression", ""))}
                for b in uses]})
        await client.close()
        text = "".join(b.text for b in reply.content if b.type == "text")
        numbers = re.findall(r"-?\d+", text)
        correct = bool(numbers) and numbers[-1] == str(ctx.label)
        return Result(reward=float(correct), score=float(correct), info={"turns": len(messages)})


AgentRunner = ChatAgentRunner(AnthropicCalculatorAgent)

"""A ChatAgent written as Molt documents it (the runner is a subclass) on the stock Anthropic SDK: one
messages call, reward 1 when the record's label appears in the reply. Only the import line is instar's."""

from anthropic import AsyncAnthropic

from instar.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


class LabelAnthropicAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        system = "\n".join(m["content"] for m in ctx.messages if m["role"] == "system")
        kwargs = {"system": system} if system else {}
        reply = await client.messages.create(model=ctx.model_name, max_tokens=ctx.sampling_params.max_tokens,
                                             messages=[m for m in ctx.messages if m["role"] != "system"], **kwargs)
        await client.close()
        text = "".join(block.text for block in reply.content if block.type == "text")
        found = float(str(ctx.label) in text)
        return Result(reward=found, score=found, info={"stop_reason": reply.stop_reason})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(LabelAnthropicAgent)

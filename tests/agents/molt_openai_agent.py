"""A ChatAgent written as Molt documents it (the runner is a subclass) on the stock OpenAI SDK: one chat
call, reward 1 when the record's label appears in the reply. Only the import line is instar's."""

from openai import AsyncOpenAI

from instar.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


class LabelChatAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        await client.close()
        found = float(str(ctx.label) in (reply.choices[0].message.content or ""))
        return Result(reward=found, score=found, info={"finish_reason": reply.choices[0].finish_reason})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(LabelChatAgent)

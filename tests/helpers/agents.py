"""The agents tests' common ground: a tiny model fine-tuned to replay a fixed script (a calculator tool call
included), the chat server and agent host on it with every engine call recorded, the OpenAI and Anthropic
tool round trips, and a scripted engine that answers every turn with the same ids."""

import asyncio
import contextlib
from pathlib import Path

import torch
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from instar.agents import AgentHost, ChatServer, SamplingParams, Task
from instar.contract import Generation
from instar.data.chat import encode, prompt_ids, render
from instar.data.tiny_model import TinySpec, build_tiny_model
from instar.engines import EmbeddedEngine
from instar.engines.protocol import Sampled

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * and integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
CALCULATOR_ANTHROPIC = {"name": "calculator", "description": CALCULATOR["function"]["description"],
                        "input_schema": CALCULATOR["function"]["parameters"]}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]}
JUDGE = "You are a judge. Reply correct or wrong."
USER = {"role": "user", "content": "What is 2+3?"}
# The conversations the fine-tuned model replays under greedy sampling: (tools, messages).
SCRIPT = [
    ([CALCULATOR], [USER, CALL, {"role": "tool", "content": "5"},
                    {"role": "assistant", "content": "The answer is 5."}]),
    (None, [USER, {"role": "assistant", "content": "The answer is 5."}, {"role": "user", "content": "Check it."},
            {"role": "assistant", "content": "It is correct."}, {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "Sure."}]),
    (None, [{"role": "system", "content": JUDGE},
            {"role": "user", "content": "Question: What is 2+3?\nAnswer: The answer is 5."},
            {"role": "assistant", "content": "correct"}]),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def scripted_model_dir(tmp_path_factory, script=SCRIPT, chat_template: str | None = None,
                       name: str = "agents_scripted_model") -> Path:
    """The tiny model trained (~2 s) until greedy decoding replays the script's assistant turns (rendered
    with ``chat_template``, the kit's by default); built once per test session and shared by every agents
    test module."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.getbasetemp() / name
    if (out / "config.json").exists():
        return out
    base = build_tiny_model(tmp_path_factory.getbasetemp() / "agents_base_model", TinySpec())
    tok, model = AutoTokenizer.from_pretrained(base), AutoModelForCausalLM.from_pretrained(base)
    tok.chat_template = chat_template or tok.chat_template
    data = []
    for tools, messages in script:
        ids = encode(tok, render(tok, messages, tools, generation_prompt=False))
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                start = len(prompt_ids(tok, messages[:i], tools))
                mask[start:ids.index(tok.eos_token_id, start) + 1] = True
        data.append((torch.tensor([ids]), mask[1:]))
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        for ids, mask in data:
            logits = model(ids).logits[0, :-1]
            torch.nn.functional.cross_entropy(logits[mask], ids[0, 1:][mask]).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


class Recorded:
    """The embedded engine, with every (prompt ids, generation, session id) it served kept for the assertions,
    and the sampling params of each call in ``params``."""

    def __init__(self, engine):
        self.engine, self.calls, self.params = engine, [], []

    async def generate(self, prompt_token_ids, sampling_params, session_id=None):
        gen = await self.engine.generate(prompt_token_ids, sampling_params, session_id)
        self.calls.append((list(prompt_token_ids), gen, session_id))
        self.params.append(sampling_params)
        return gen

    async def stream(self, prompt_token_ids, sampling_params, session_id=None):
        async for item in self.engine.stream(prompt_token_ids, sampling_params, session_id):
            if isinstance(item, Generation):
                self.calls.append((list(prompt_token_ids), item, session_id))
                self.params.append(sampling_params)
            yield item

    def release(self, session_id):
        self.engine.release(session_id)


@contextlib.asynccontextmanager
async def serving(scripted, max_len=1024, max_new_tokens=64, tool_parser="hermes"):
    """The chat server on the scripted model's embedded engine (recorded): yields (server, engine)."""
    engine = Recorded(EmbeddedEngine.from_pretrained(scripted.path))
    try:
        async with ChatServer(engine, scripted.tokenizer, model_name="tiny", max_len=max_len,
                              max_new_tokens=max_new_tokens, tool_parser=tool_parser) as server:
            yield server, engine
    finally:
        await engine.engine.close()


@contextlib.asynccontextmanager
async def hosting(scripted, runner, max_len=1024, max_new_tokens=64, agent_timeout=30.0, system_prompt=None):
    """The agent host running ``runner`` on the scripted model's embedded engine (recorded): yields (host, engine)."""
    engine = Recorded(EmbeddedEngine.from_pretrained(scripted.path))
    try:
        async with AgentHost(runner, engine, scripted.tokenizer, max_len=max_len, max_new_tokens=max_new_tokens,
                             agent_timeout=agent_timeout, system_prompt=system_prompt, model_name="tiny") as host:
            yield host, engine
    finally:
        await engine.engine.close()


def task(label="5", prompt="What is 2+3?", **kw) -> Task:
    return Task(prompt=prompt, label=label, sampling_params=GREEDY, rollout_id="r0", prompt_index=7, group_id=3, **kw)


def chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)


TOOL_TURNS = (('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>', 1),
              ("\n" + chatml(("user", "<tool_response>\n5\n</tool_response>")) + "<|im_start|>assistant\n", 0),
              ("The answer is 5.", 1))


def tool_conversation_ids(tok) -> tuple[list[int], list[int]]:
    """The one token sequence (ids, action mask) every calculator agent (Env, OpenAI, Anthropic) must record."""
    ids = prompt_ids(tok, [USER], [CALCULATOR])
    mask = [0] * len(ids)
    for text, sampled in TOOL_TURNS:
        part = encode(tok, text) + ([tok.eos_token_id] if sampled else [])
        ids, mask = ids + part, mask + [sampled] * len(part)
    return ids, mask


async def openai_tool_round_trip(session, stream: bool) -> list[dict]:
    """The calculator conversation over Chat Completions (the stock SDK): each reply as a dict."""
    client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    messages, replies = [USER], []
    for _ in range(2):
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model="tiny", messages=messages, tools=[CALCULATOR], stream=True)]
            calls = [tc.model_dump() for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
            for call in calls:
                call.pop("index")
            reply = {"role": "assistant", "content": "".join(c.choices[0].delta.content or "" for c in chunks) or None,
                     "tool_calls": calls or None, "finish": chunks[-1].choices[0].finish_reason,
                     "usage": chunks[-1].usage.model_dump(exclude_none=True)}
        else:
            r = await client.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR])
            reply = {**r.choices[0].message.model_dump(include={"role", "content", "tool_calls"}),
                     "finish": r.choices[0].finish_reason, "usage": r.usage.model_dump(exclude_none=True)}
        replies.append(reply)
        messages.append({k: v for k, v in reply.items() if k in ("role", "content", "tool_calls") and v is not None})
        for call in reply["tool_calls"] or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "5"})
    await client.close()
    return replies


async def anthropic_tool_round_trip(session, stream: bool) -> list:
    """The calculator conversation over the Messages API (the stock SDK): the SDK's reply objects."""
    client = AsyncAnthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)
    messages, replies = [USER], []
    for _ in range(2):
        kwargs = dict(model="tiny", max_tokens=64, messages=messages, tools=[CALCULATOR_ANTHROPIC])
        if stream:
            async with client.messages.stream(**kwargs) as events:
                reply = await events.get_final_message()
        else:
            reply = await client.messages.create(**kwargs)
        replies.append(reply)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "5"}
                                                     for b in reply.content if b.type == "tool_use"]})
    await client.close()
    return replies


class ScriptedEngine:
    """Answers every turn with ``reply`` (sampled ids ending with the end-of-turn id); ``fail`` makes
    the next calls raise, ``hang`` makes them wait until cancelled."""

    def __init__(self, tok):
        self.reply = encode(tok, "ok") + [tok.eos_token_id]
        self.prompts, self.params = [], []
        self.fail, self.hang, self.cancelled = 0, False, asyncio.Event()

    async def generate(self, prompt_token_ids, sampling_params, session_id=None):
        self.prompts.append(list(prompt_token_ids))
        self.params.append(sampling_params)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("engine connection lost")
        if self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        n = len(self.reply)
        return Generation(list(self.reply), [-0.5] * n, [7] * n, "stop")

    async def stream(self, prompt_token_ids, sampling_params, session_id=None):
        gen = await self.generate(prompt_token_ids, sampling_params, session_id)
        yield Sampled(0, list(gen.token_ids))  # the whole turn at once
        yield gen

    def release(self, session_id):
        pass  # nothing is cached per session

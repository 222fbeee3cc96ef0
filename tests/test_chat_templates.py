"""--data.chat_template / --data.chat_template_kwargs (and --sft.*): the template and its variables reach every
rendering of a conversation through `load_tokenizer` (RL prompts, each chat-server route), and a template that
cannot be read or parsed is a one-line ConfigError before anything starts."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from anthropic import AsyncAnthropic
from helpers.agents import GREEDY, USER, hosting, serving, task
from openai import AsyncOpenAI

from instar.agents import load_agent
from instar.checks import check
from instar.cli.main import main
from instar.config import ConfigError, DataConfig, RLConfig, SFTConfig, SFTSection
from instar.data.chat import encode, load_tokenizer, render
from instar.train.sft import run_sft

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
SWITCH = str(TEMPLATES / "thinking_switch.jinja")
MATH_ENV = Path(__file__).resolve().parents[1] / "examples" / "agents" / "math_env.py"
PROMPT = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
NO_THINKING = PROMPT + "<think>\n\n</think>\n\n"


def test_kwargs_are_fixed_in_the_template_and_override_a_callers(tiny_model_dir, tmp_path):
    on, off = load_tokenizer(tiny_model_dir, SWITCH), load_tokenizer(tiny_model_dir, SWITCH, {"enable_thinking": False})
    assert render(on, [USER], generation_prompt=True) == PROMPT
    assert render(off, [USER], generation_prompt=True) == NO_THINKING
    assert off.apply_chat_template([USER], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=True) == NO_THINKING
    # kwargs alone keep the checkpoint's own template
    plain, own = load_tokenizer(tiny_model_dir), load_tokenizer(tiny_model_dir, template_kwargs={"enable_thinking": 0})
    assert render(own, [USER], generation_prompt=True) == render(plain, [USER], generation_prompt=True) == PROMPT
    # values of every JSON type reach the template unchanged
    (tmp_path / "echo.jinja").write_text("{{ v | tojson }}")
    echo = load_tokenizer(tiny_model_dir, str(tmp_path / "echo.jinja"), {"v": [1, 2.5e-5, None, True, {"k": "it's\n"}]})
    assert render(echo, [USER], generation_prompt=False) == '[1, 2.5e-05, null, true, {"k": "it\'s\\n"}]'


@pytest.mark.asyncio
async def test_an_rl_prompt_is_rendered_with_the_kwargs_and_recorded_exactly(scripted):
    tok = load_tokenizer(scripted.path, SWITCH, {"enable_thinking": False})
    async with hosting(SimpleNamespace(path=scripted.path, tokenizer=tok), load_agent(str(MATH_ENV))) as (host, engine):
        traj = await host.rollout(task("5"))
    prompt, gen, _ = engine.calls[0]
    assert prompt == encode(tok, NO_THINKING)
    [seg] = traj.segments
    assert seg.token_ids == prompt + gen.token_ids
    assert seg.action_mask == [0] * len(prompt) + [1] * len(gen.token_ids)


@pytest.mark.asyncio
async def test_every_chat_server_route_renders_with_the_kwargs(scripted):
    tok = load_tokenizer(scripted.path, SWITCH, {"enable_thinking": False})
    async with serving(SimpleNamespace(path=scripted.path, tokenizer=tok)) as (server, engine):
        sessions = [server.open(GREEDY) for _ in range(3)]
        openai = [AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0) for s in sessions[:2]]
        await openai[0].chat.completions.create(model="tiny", messages=[USER])
        await openai[1].responses.create(model="tiny", input=USER["content"])
        anthropic = AsyncAnthropic(base_url=sessions[2].session_url, api_key=sessions[2].api_key, max_retries=0)
        await anthropic.messages.create(model="tiny", max_tokens=8, messages=[USER])
        for client in (*openai, anthropic):
            await client.close()
    assert [ids for ids, _, _ in engine.calls] == [encode(tok, NO_THINKING)] * 3


def test_a_template_that_is_missing_or_does_not_parse_is_a_one_line_config_error(tmp_path, tiny_model_dir):
    missing = RLConfig(data=DataConfig(chat_template=str(tmp_path / "none.jinja")))
    with pytest.raises(ConfigError, match=r"^--data.chat_template '.*none.jinja' cannot be read \(No such file"):
        check(missing)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }}")
    bad = RLConfig(data=DataConfig(chat_template=str(tmp_path / "bad.jinja")))
    with pytest.raises(ConfigError, match=r"^--data.chat_template '.*bad.jinja' does not parse as Jinja \(line 1: "
                                          r"Unexpected end of template.*\); fix it$"):
        check(bad)
    with pytest.raises(ConfigError, match=r"^--data.chat_template_kwargs \{'enable-thinking': False\} does not parse"):
        check(RLConfig(data=DataConfig(chat_template_kwargs={"enable-thinking": False})))
    with pytest.raises(SystemExit, match=r"^instar eval: --data.chat_template '.*none.jinja' cannot be read"):
        main(["eval", "--actor.model_name_or_path", str(tiny_model_dir), "--data.chat_template",
              str(tmp_path / "none.jinja")])  # before any Ray actor starts
    sft = SFTConfig(sft=SFTSection(dataset="unused.jsonl", chat_template=str(tmp_path / "bad.jinja")))
    with pytest.raises(ConfigError, match=r"^--sft.chat_template '.*bad.jinja' does not parse"):
        run_sft(sft)  # before any model or data is loaded

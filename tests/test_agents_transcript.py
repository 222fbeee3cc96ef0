"""The accumulator on the embedded engine with random tiny models: deltas, budgets, sealing, MoE routing."""

import pytest
import pytest_asyncio
from helpers.agents import Recorded
from transformers import AutoTokenizer

from instar.agents import SamplingParams, Transcript
from instar.contract import NO_VERSION
from instar.data.chat import encode, prompt_ids
from instar.engines import EmbeddedEngine

USER = [{"role": "user", "content": "What is 2+3?"}]
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


@pytest_asyncio.fixture
async def engine(tiny_model_dir):
    engine = Recorded(EmbeddedEngine.from_pretrained(tiny_model_dir))
    yield engine
    await engine.engine.close()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.asyncio
async def test_a_cut_off_turn_truncates_and_the_next_delta_carries_the_templates_end_token(engine, tok):
    transcript = Transcript(engine, tok, session_id="s", max_len=512, max_new_tokens=4)
    turn = await transcript.sample(USER, None, SamplingParams(seed=1, max_tokens=50))
    assert turn.finish_reason == "length" and len(turn.token_ids) == 4 and transcript.truncated
    assert engine.params[0].max_tokens == 4 and engine.params[0].stop_token_ids == [tok.eos_token_id]
    await transcript.sample([*transcript.messages, {"role": "user", "content": "ok"}], None, SamplingParams(seed=2))
    delta = encode(tok, "<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")
    prompt, gens = prompt_ids(tok, USER), [gen for _, gen, _ in engine.calls]
    [seg] = transcript.segments
    assert seg.token_ids == prompt + gens[0].token_ids + delta + gens[1].token_ids
    assert engine.calls[1][0] == prompt + gens[0].token_ids + delta
    assert seg.versions == [NO_VERSION] * len(prompt) + [0] * 4 + [NO_VERSION] * len(delta) + [0] * 4
    seg.validate()


@pytest.mark.asyncio
async def test_context_budget_clamps_the_turn_then_ends_the_rollout_without_sampling(engine, tok):
    n_prompt = len(prompt_ids(tok, USER))
    transcript = Transcript(engine, tok, session_id="s", max_len=n_prompt + 3, max_new_tokens=50)
    turn = await transcript.sample(USER, None, SamplingParams(seed=1))
    assert len(turn.token_ids) == 3 and engine.params[0].max_tokens == 3
    last = await transcript.sample([*transcript.messages, {"role": "user", "content": "more"}], None)
    assert (last.token_ids, last.finish_reason, transcript.truncated) == ([], "length", True)
    assert len(engine.calls) == 1
    assert len(transcript.segments[0].token_ids) == n_prompt + 3


@pytest.mark.asyncio
async def test_changed_tools_or_resampling_the_same_prompt_open_new_segments(engine, tok):
    transcript = Transcript(engine, tok, session_id="s", max_len=512, max_new_tokens=3)
    await transcript.sample(USER, None, SamplingParams(seed=1))
    again = await transcript.sample(USER, None, SamplingParams(seed=1))  # identical: from cache
    assert len(engine.calls) == 1 and again.token_ids == engine.calls[0][1].token_ids
    await transcript.sample(USER, None, SamplingParams(seed=2))  # a fresh sample of the same prompt
    await transcript.sample([*transcript.messages, {"role": "user", "content": "x"}], TOOLS, SamplingParams(seed=3))
    segments = transcript.segments
    assert len(segments) == 3
    for seg, (prompt, gen, _) in zip(segments, engine.calls, strict=True):
        assert seg.token_ids[:len(prompt) + len(gen.token_ids)] == prompt + gen.token_ids
    assert engine.calls[2][0] == prompt_ids(tok, transcript.messages[:-1], TOOLS)


@pytest.mark.asyncio
async def test_moe_routing_of_sampled_tokens_is_kept_aligned_with_the_segment(tiny_moe_dir):
    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    engine = Recorded(EmbeddedEngine.from_pretrained(tiny_moe_dir))
    try:
        transcript = Transcript(engine, tok, session_id="s", max_len=512, max_new_tokens=3)
        await transcript.sample(USER, None, SamplingParams(seed=1))
        await transcript.sample([*transcript.messages, {"role": "user", "content": "x"}], None, SamplingParams(seed=2))
    finally:
        await engine.engine.close()
    [seg] = transcript.segments
    seg.validate()
    assert tuple(seg.routed_experts.shape) == (len(seg.token_ids), 2, 2)
    actions = [i for i, m in enumerate(seg.action_mask) if m]
    sampled = [row for _, gen, _ in engine.calls for row in gen.routed_experts]
    assert all((seg.routed_experts[i] == row).all() for i, row in zip(actions, sampled, strict=True))
    template = [i for i, m in enumerate(seg.action_mask) if not m]
    assert (seg.routed_experts[template] == -1).all()
    assert (seg.routed_experts[actions] >= 0).all()

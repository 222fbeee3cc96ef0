"""The vLLM engine on vLLM's CPU build against the embedded engine and HF transformers (both fp32):
greedy tokens, logprobs, sampling settings, seeds, stop ids, pause modes. One engine for the module.

Tolerance: fp32 against fp32, different kernels: logprobs agree within 1e-4 (measured: ~5e-7).
"""

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm_tier import hf_logits, hf_logprobs, needs_vllm, start_engine, wait_until

from instar.config import EngineConfig
from instar.contract import SamplingParams
from instar.engines import EmbeddedEngine
from instar.engines.sampling import filter_logits

pytestmark = needs_vllm
PROMPTS = [[5, 77, 301], [12, 400, 9, 250, 33, 71, 2, 18, 90, 91, 92, 300, 301, 302, 17, 16, 15],
           [260, 261, 262, 263, 264, 265, 266, 267, 268], [100 + i for i in range(30)]]
TOL = 1e-4


@pytest.fixture(scope="module")
def vllm(vllm_model_dir):
    """(engine, loop): one fp32 engine for the module; ``loop.run(coro)`` runs on the engine's loop."""
    with start_engine(vllm_model_dir, EngineConfig(enforce_eager=True, max_num_seqs=16,
                                                   max_num_batched_tokens=1024)) as pair:
        yield pair


@pytest.fixture(scope="module")
def dense(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def generate_all(vllm, prompts, params):
    engine, loop = vllm

    async def body():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    return loop.run(body())


def test_greedy_matches_embedded_engine(vllm, dense):
    params = SamplingParams(temperature=0, max_tokens=12)

    async def embedded():
        engine = EmbeddedEngine(dense)
        try:
            return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
        finally:
            await engine.close()

    for prompt, got, want in zip(PROMPTS, generate_all(vllm, PROMPTS, params), asyncio.run(embedded())):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == "length" and got.versions == [0] * 12
        assert got.logprobs == pytest.approx(want.logprobs, abs=TOL)  # greedy: the raw logprob
        assert got.logprobs == pytest.approx(hf_logprobs(dense, prompt, got.token_ids).tolist(), abs=TOL)


def test_checkpoint_generation_config_never_leaks(vllm, dense):
    """The checkpoint says temperature 0.05, top_k 1, repetition_penalty 3, 2 new tokens, eos [1, 2, 3]:
    none of it may apply. At temperature 1 with no filter the logprob is the raw model's."""
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=11)
    for prompt, gen in zip(PROMPTS, generate_all(vllm, PROMPTS, params)):
        assert len(gen.token_ids) == 40 and gen.finish_reason == "length"
        assert gen.logprobs == pytest.approx(hf_logprobs(dense, prompt, gen.token_ids).tolist(), abs=TOL)
        assert min(gen.logprobs) < -4  # a flat random model: top_k=1 or temperature 0.05 would give ~0


@pytest.mark.parametrize("settings", [dict(temperature=0.7), dict(temperature=1.3, top_k=5),
                                      dict(temperature=1.0, min_p=0.5)])
def test_processed_logprobs_follow_the_sampling_settings(vllm, dense, settings):
    params = SamplingParams(max_tokens=10, seed=3, **settings)
    for prompt, gen in zip(PROMPTS, generate_all(vllm, PROMPTS, params)):
        filtered = filter_logits(hf_logits(dense, prompt, gen.token_ids), [params] * 10)
        assert torch.isfinite(filtered.gather(1, torch.tensor(gen.token_ids)[:, None])).all()  # never filtered out
        expected = filtered.log_softmax(-1).gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        assert gen.logprobs == pytest.approx(expected.tolist(), abs=TOL)


def test_seed_reproduces_samples_whatever_the_batch(vllm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    alone = generate_all(vllm, [PROMPTS[1]], params)[0]
    crowd = generate_all(vllm, PROMPTS, params)
    other_seed = generate_all(vllm, [PROMPTS[1]], params.replace(seed=1))[0]
    assert crowd[1].token_ids == alone.token_ids
    assert crowd[1].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert other_seed.token_ids != alone.token_ids


def test_stop_token_ends_the_turn_and_is_kept(vllm):
    greedy = generate_all(vllm, [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    gen = generate_all(vllm, [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[greedy[3]]))[0]
    assert gen.token_ids == greedy[: greedy.index(greedy[3]) + 1]
    assert gen.finish_reason == "stop"


def test_pause_keep_freezes_then_resume_finishes(vllm):
    engine, loop = vllm
    future = asyncio.run_coroutine_threadsafe(
        engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=300)), loop.loop)
    wait_until(lambda: engine.load().running == 1)
    time.sleep(0.2)
    loop.run(engine.pause("keep"))
    time.sleep(0.5)
    assert not future.done() and engine.load().running == 1  # frozen, not finished
    loop.run(engine.resume())
    gen = future.result(timeout=60)
    assert len(gen.token_ids) == 300 and gen.finish_reason == "length" and gen.versions == [0] * 300
    assert engine.load().running == 0


def test_pause_abort_returns_the_tokens_so_far(vllm, dense):
    engine, loop = vllm
    future = asyncio.run_coroutine_threadsafe(
        engine.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=2000)), loop.loop)
    wait_until(lambda: engine.load().running == 1)
    time.sleep(0.3)
    loop.run(engine.pause("abort"))
    gen = future.result(timeout=30)
    loop.run(engine.resume())
    assert gen.finish_reason == "abort"
    assert 0 < len(gen.token_ids) < 2000
    assert len(gen.logprobs) == len(gen.versions) == len(gen.token_ids)
    assert gen.logprobs == pytest.approx(hf_logprobs(dense, PROMPTS[2], gen.token_ids).tolist(), abs=TOL)


def test_pause_drain_lets_running_requests_finish_and_holds_new_ones(vllm):
    engine, loop = vllm
    running = asyncio.run_coroutine_threadsafe(
        engine.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=400)), loop.loop)
    wait_until(lambda: engine.load().running == 1)
    # drain is vLLM's "wait": it drains scheduled requests; one its core has not scheduled yet is held like
    # a new one until resume. Give the core a moment to schedule it (400 tokens keep it running meanwhile).
    time.sleep(0.3)
    loop.run(engine.pause("drain"))
    finished = running.result(timeout=60)  # before any resume: it ran to the end while paused
    assert len(finished.token_ids) == 400 and finished.finish_reason == "length"  # finished, not cut
    later = asyncio.run_coroutine_threadsafe(
        engine.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5)), loop.loop)
    time.sleep(0.5)
    assert not later.done()  # held until resume
    loop.run(engine.resume())
    assert later.result(timeout=30).token_ids == finished.token_ids[:5]


def test_stats_count_what_was_served(vllm):
    engine, loop = vllm
    before = dict(engine.stats)
    gen = loop.run(engine.generate([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=3), "s"))
    engine.release("s")  # vLLM finds prefixes by their tokens: nothing to forget, and no error
    again = loop.run(engine.generate([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=3)))
    delta = {k: engine.stats[k] - before[k] for k in before}
    assert delta["prompt_tokens"] == 10 and delta["sampled_tokens"] == len(gen.token_ids) + len(again.token_ids)
    assert 0 <= delta["prefix_hit_tokens"] <= 5  # the second prompt may hit vLLM's block-aligned cache


def test_errors_name_the_problem(vllm):
    engine, loop = vllm
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        loop.run(engine.generate([1, 99999], SamplingParams()))
    with pytest.raises(ValueError, match="non-empty"):
        loop.run(engine.generate([], SamplingParams()))
    with pytest.raises(RuntimeError, match="pause"):
        loop.run(engine.update_weights([], version=1))

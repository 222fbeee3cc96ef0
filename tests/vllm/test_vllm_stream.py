"""The vLLM engine's stream on vLLM's CPU build: increments as vLLM samples them, adding up to the same
Generation as `generate` for the same seed; closing the stream early aborts the vLLM request."""

import asyncio

import pytest
from vllm_tier import needs_vllm, start_engine

from instar.config import EngineConfig
from instar.contract import Generation, SamplingParams
from instar.engines.protocol import Sampled

pytestmark = needs_vllm
PROMPT = [12, 400, 9, 250, 33, 71, 2, 18]


@pytest.fixture(scope="module")
def vllm(vllm_model_dir):
    with start_engine(vllm_model_dir, EngineConfig(enforce_eager=True, max_num_seqs=4,
                                                   max_num_batched_tokens=256)) as pair:
        yield pair


def test_stream_yields_increments_then_the_same_generation_as_generate(vllm):
    engine, loop = vllm
    # long enough that a consumer slowed by a busy machine still sees several engine steps' outputs
    params = SamplingParams(temperature=1.0, max_tokens=200, seed=5)

    async def body():
        items = [item async for item in engine.stream(PROMPT, params)]
        return items, await engine.generate(PROMPT, params)

    items, want = loop.run(body())
    *increments, final = items
    assert isinstance(final, Generation) and all(isinstance(i, Sampled) for i in increments)
    assert len(increments) > 1  # one output per engine step, not one at the end
    starts = [sum(len(j.token_ids) for j in increments[:n]) for n in range(len(increments))]
    assert [i.start for i in increments] == starts
    assert [t for i in increments for t in i.token_ids] == final.token_ids == want.token_ids
    assert (final.logprobs, final.versions, final.finish_reason) == (want.logprobs, want.versions, want.finish_reason)


def test_closing_a_stream_early_aborts_the_request(vllm):
    engine, loop = vllm

    async def body():
        stream = engine.stream(PROMPT, SamplingParams(temperature=1.0, max_tokens=2000, seed=5))
        first = await anext(stream)
        running = engine.load().running
        await stream.aclose()
        for _ in range(3000):  # vLLM drops the aborted request from its output processor
            if not engine.llm.output_processor.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return first, running, engine.load().running, engine.llm.output_processor.has_unfinished_requests()

    first, running, after, unfinished = loop.run(body())
    assert isinstance(first, Sampled) and first.start == 0 and running == 1
    assert (after, unfinished) == (0, False)

"""Weight updates into the vLLM engine: partial rollouts across pause("keep") -> update -> resume, the
tied output head, the prefix-cache reset, and the trainer's broadcast group straight into vLLM's
worker (gloo here; NCCL on GPU). Model A is the tiny model, model B the same shapes with other
weights (tied embeddings in both). One fp32 engine for the module; each test leaves model A loaded.
"""

import asyncio
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm_tier import hf_logits, hf_logprobs, needs_vllm, start_engine, wait_until

from instar.config import EngineConfig
from instar.contract import SamplingParams
from instar.train.launch import reserve_port
from instar.train.weight_sync import open_sync_group, receive_weights, send_weights

pytestmark = needs_vllm
PROMPT = [12, 400, 9, 250, 33, 71, 2, 18]
GREEDY = SamplingParams(temperature=0, max_tokens=4)
TOL = 1e-4


@pytest.fixture(scope="module")
def vllm(vllm_model_dir):
    with start_engine(vllm_model_dir, EngineConfig(enforce_eager=True, max_num_seqs=8,
                                                   max_num_batched_tokens=1024)) as pair:
        yield pair


@pytest.fixture(scope="module")
def models(tiny_model_dir, model_b_dir):
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    b = AutoModelForCausalLM.from_pretrained(model_b_dir).eval()
    assert a.config.tie_word_embeddings and not torch.equal(a.lm_head.weight, b.lm_head.weight)
    return a, b


def swap(vllm, named_tensors, version):
    engine, loop = vllm

    async def body():
        await engine.pause("keep")
        await engine.update_weights(named_tensors, version)
        await engine.resume()

    loop.run(body())


def assert_greedy_under(model, prompt, tokens):
    """Each greedy token is the model's best (or within TOL of it: ties in a flat random model)."""
    logprobs = hf_logits(model, prompt, tokens).log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (logprobs.max(-1).values - chosen).max() < TOL


@pytest.mark.parametrize("head", ["tied", "explicit"])
def test_keep_pause_update_resume_mid_request(vllm, models, head):
    """tied: the trainer sends the shared weight once (no lm_head.weight), explicit: both names."""
    engine, loop = vllm
    a, b = models

    def named(model):
        return model.named_parameters(remove_duplicate=head == "tied")

    N = 1200  # long enough that the swap, 0.3 s in, lands mid-request on a fast machine too
    start = engine.version
    warm = loop.run(engine.generate(PROMPT, GREEDY))  # leaves PROMPT in the prefix cache
    assert warm.logprobs == pytest.approx(hf_logprobs(a, PROMPT, warm.token_ids).tolist(), abs=TOL)

    future = asyncio.run_coroutine_threadsafe(
        engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N)), loop.loop)
    wait_until(lambda: engine.load().running == 1)
    time.sleep(0.3)
    try:
        swap(vllm, named(b), start + 1)
        gen = future.result(timeout=60)
        after = loop.run(engine.generate(PROMPT, GREEDY))
    finally:
        swap(vllm, named(a), start + 2)

    assert gen.finish_reason == "length" and len(gen.token_ids) == N  # the in-flight request finished
    k = gen.versions.count(start)
    assert 0 < k < N, f"the swap should land mid-request; {k} of {N} tokens came before it"
    assert gen.versions == [start] * k + [start + 1] * (N - k)
    got = torch.tensor(gen.logprobs)
    assert (got[:k] - hf_logprobs(a, PROMPT, gen.token_ids[:k])).abs().max() < TOL
    # After the swap: model B over the whole context (vLLM re-prefilled the preempted request).
    assert (got[k:] - hf_logprobs(b, PROMPT, gen.token_ids)[k:]).abs().max() < TOL
    assert_greedy_under(a, PROMPT, gen.token_ids[:k])
    assert_greedy_under(b, PROMPT + gen.token_ids[:k], gen.token_ids[k:])
    # A cached prompt is recomputed under the new weights too (the prefix cache was reset).
    assert after.versions == [start + 1] * 4
    assert after.logprobs == pytest.approx(hf_logprobs(b, PROMPT, after.token_ids).tolist(), abs=TOL)
    assert engine.version == start + 2


def test_broadcast_group_into_the_vllm_worker(vllm, models):
    """The trainer's rank 0 broadcasts model B over gloo; the vLLM worker receives it itself."""
    engine, loop = vllm
    a, b = models
    port, trainer = reserve_port(), {}
    opener = threading.Thread(target=lambda: trainer.update(group=open_sync_group("127.0.0.1", port, 0, 2)))
    opener.start()
    loop.run(engine.join_weight_group(open_sync_group, "127.0.0.1", port, first_rank=1, world_size=2), timeout=60)
    opener.join(timeout=60)
    first = engine.version + 1

    def broadcast(model, version):
        sender = threading.Thread(target=lambda: trainer.update(stats=send_weights(model.named_parameters(),
                                                                                   trainer["group"])))
        loop.run(engine.pause("keep"))
        sender.start()
        loop.run(engine.receive_weights(receive_weights, version), timeout=60)
        sender.join(timeout=60)
        loop.run(engine.resume())

    broadcast(b, first)
    gen = loop.run(engine.generate(PROMPT, GREEDY))
    assert trainer["stats"]["weight_sync/bytes"] > 0
    assert gen.versions == [first] * 4
    assert gen.logprobs == pytest.approx(hf_logprobs(b, PROMPT, gen.token_ids).tolist(), abs=TOL)
    broadcast(a, first + 1)
    gen = loop.run(engine.generate(PROMPT, GREEDY))
    assert gen.logprobs == pytest.approx(hf_logprobs(a, PROMPT, gen.token_ids).tolist(), abs=TOL)

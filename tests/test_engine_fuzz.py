"""Random workloads on the embedded engine, checked against the model itself: every sampled token's logprob
equals HF's teacher-forced one, and every turn ends for the reason its tokens give. Groups share prompts
(prefix sharing), a tenth of the vocabulary stops a turn (so turns often end at their first token), sessions
continue from their cached prefix, some requests are cancelled mid-turn, and a small engine queues requests
and splits prefills: the paths where keys/values move between slots. With weight updates at random moments
(pause keep or drain), each token's logprob is that of the weights its version names."""

import asyncio
import contextlib
import copy
import random

import pytest
import torch
from helpers.engine import hf_logprobs, run_engine
from transformers import AutoModelForCausalLM

from instar.config import EngineConfig
from instar.contract import SamplingParams

VOCAB = 512


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 20))]


async def _workload(engine, rng: random.Random, stop: list[int]) -> list[tuple[list[int], object]]:
    """Two waves of groups; the second continues some sessions of the first. Returns (prompt, generation)."""
    done: list[tuple[list[int], object]] = []
    sessions: dict[str, list[int]] = {}

    async def one(prompt: list[int], session: str | None, cancel: bool) -> None:
        params = SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 8), stop_token_ids=stop,
                                seed=rng.randrange(1 << 30))
        call = engine.generate(prompt, params, session)
        if cancel:  # gone after a step or two: the others must not notice
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(call, timeout=rng.uniform(0.0, 0.01))
            return
        gen = await call
        done.append((prompt, gen))
        if session is not None:
            sessions[session] = prompt + gen.token_ids

    for wave in range(2):
        calls = []
        for g in range(rng.randint(4, 8)):
            continued = [s for s in sessions if rng.random() < 0.5] if wave else []
            if continued:  # the next turn of a session: its whole history plus a new message
                session = continued[0]
                prompt = sessions.pop(session) + _prompt(rng)
                calls.append(one(prompt, session, False))
                continue
            prompt = _prompt(rng)
            for k in range(rng.randint(2, 4)):  # a group: one prompt, several samples
                calls.append(one(prompt, f"w{wave}-g{g}-{k}", rng.random() < 0.1))
        await asyncio.gather(*calls)
    return done


@pytest.mark.parametrize("cfg", [EngineConfig(), EngineConfig(max_num_seqs=3, max_num_batched_tokens=16)],
                         ids=["default", "small"])
@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_sample_exactly_the_models_distribution(model, cfg, seed):
    rng = random.Random(seed)
    stop = rng.sample(range(3, VOCAB), VOCAB // 10)
    done = run_engine(model, lambda engine: _workload(engine, rng, stop), cfg)
    assert len(done) > 10 and any(len(g.token_ids) == 1 for _, g in done)  # some ended at their first token
    for prompt, gen in done:
        assert gen.logprobs == pytest.approx(hf_logprobs(model, prompt, gen.token_ids).tolist(), abs=1e-4)
        ended = gen.token_ids[-1] in stop
        assert gen.finish_reason == ("stop" if ended else "length")
        assert not any(t in stop for t in gen.token_ids[:-1])


def _moved(model, seed: int, scale: float = 0.05):
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return new


@pytest.mark.parametrize("seed", range(4))
def test_weight_updates_at_random_moments_keep_every_token_to_its_version(model, seed):
    rng = random.Random(100 + seed)
    stop = rng.sample(range(3, VOCAB), VOCAB // 20)
    versions = [model, _moved(model, 1), _moved(model, 2)]
    versions.append(versions[1])  # version 3 loads the weights of 1 again: a drain reuses its spare model
    modes = []

    async def body(engine):
        async def trainer():  # three updates while the workload runs, each paused in a random mode
            for v in (1, 2, 3):
                for _ in range(rng.randint(1, 10)):  # the engine takes a step per turn of the event loop
                    await asyncio.sleep(0)
                modes.append(rng.choice(["keep", "drain"]))
                await engine.pause(modes[-1])
                await engine.update_weights(versions[v].named_parameters(), version=v)
                await engine.resume()
        done, _ = await asyncio.gather(_workload(engine, rng, stop), trainer())
        return done

    done = run_engine(model, body)
    seen = {v for _, g in done for v in g.versions}
    assert len(seen) > 1, (seen, modes)
    for prompt, gen in done:
        want = {v: hf_logprobs(versions[v], prompt, gen.token_ids) for v in set(gen.versions)}
        got = [want[v][t].item() for t, v in enumerate(gen.versions)]
        assert gen.logprobs == pytest.approx(got, abs=1e-4), (gen.versions, modes)

"""The embedded engine against HF transformers on the tiny models (fp32): greedy tokens, logprobs,
seeds, partial rollouts across a weight update, MoE routing, prefix reuse, pause modes."""

import asyncio
import copy

import pytest
import torch
from helpers.engine import DEVICES, PROMPTS, hf_greedy, hf_logprobs, perturbed, run_engine, swap_mid_turn
from transformers import AutoModelForCausalLM

from instar.config import EngineConfig
from instar.contract import SamplingParams
from instar.engines import EmbeddedEngine


@pytest.fixture(scope="module")
def moe(tiny_moe_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_moe_dir).eval()


# max_num_seqs=2 makes requests queue and join the batch as others leave; a tiny prefill budget splits
# the prefills into several forwards.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [EngineConfig(), EngineConfig(max_num_seqs=2, max_num_batched_tokens=16)])
def test_greedy_matches_hf_generate(dense, cfg, device):
    eos = dense.config.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[eos])

    async def body(engine):
        return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))

    for prompt, gen in zip(PROMPTS, run_engine(dense, body, cfg, device)):
        assert gen.token_ids == hf_greedy(dense, prompt, 12)
        assert gen.finish_reason == ("stop" if gen.token_ids[-1] == eos else "length")
        assert gen.versions == [0] * len(gen.token_ids)
        # Greedy returns the raw logprob.
        assert torch.allclose(torch.tensor(gen.logprobs), hf_logprobs(dense, prompt, gen.token_ids), atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,temperature,top_k", [("processed", 0.7, -1), ("raw", 0.7, -1), ("processed", 1.3, 5)])
def test_logprobs_match_full_forward(dense, mode, temperature, top_k, device):
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=10, seed=3)

    async def body(engine):
        return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))

    for prompt, gen in zip(PROMPTS, run_engine(dense, body, EngineConfig(logprobs_mode=mode), device)):
        with torch.no_grad():
            logits = dense(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1:-1]
        if mode == "raw":
            expected = logits.log_softmax(-1)
        else:
            scaled = logits / temperature
            if top_k > 0:
                kth = scaled.topk(top_k, dim=-1).values[:, -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            expected = scaled.log_softmax(-1)
        expected = expected.gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        assert (torch.tensor(gen.logprobs) - expected).abs().max() < 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproduces_samples_whatever_the_batch(dense, device):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)

    async def body(engine):
        alone = await engine.generate(PROMPTS[1], params)
        crowd = await asyncio.gather(*(engine.generate(p, params.replace(seed=i)) for i, p in enumerate(PROMPTS)),
                                     engine.generate(PROMPTS[1], params))
        return alone, crowd

    alone, crowd = run_engine(dense, body, device=device)
    assert crowd[-1].token_ids == alone.token_ids
    assert crowd[-1].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert crowd[1].token_ids != alone.token_ids  # seed 1 instead of 1234


def test_stop_token_ends_the_turn(dense):
    greedy = hf_greedy(dense, PROMPTS[0], 8)
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[greedy[3]])

    async def body(engine):
        return await engine.generate(PROMPTS[0], params)

    gen = run_engine(dense, body)
    stop_at = greedy.index(greedy[3])
    assert gen.token_ids == greedy[: stop_at + 1]
    assert gen.finish_reason == "stop"


@pytest.mark.parametrize("device", DEVICES)
def test_weight_update_during_keep_pause(dense, device):
    new_model = perturbed(dense)
    prompt = PROMPTS[2]

    async def body(engine):
        async def frozen():  # no progress while paused
            before = engine._running[0].num_sampled
            for _ in range(5):
                await asyncio.sleep(0)
            assert engine._running[0].num_sampled == before
        return await swap_mid_turn(engine, "keep", new_model, prompt, frozen)

    before, gen = run_engine(dense, body, device=device)
    assert gen.versions == [0] * before + [1] * (12 - before)
    old_part, new_part = gen.token_ids[:before], gen.token_ids[before:]
    assert old_part == hf_greedy(dense, prompt, before)
    assert new_part == hf_greedy(new_model, prompt + old_part, 12 - before)
    got = torch.tensor(gen.logprobs)
    assert (got[:before] - hf_logprobs(dense, prompt, old_part)).abs().max() < 1e-4
    # After the swap: the new weights over the whole context (the running request was re-prefilled).
    assert (got[before:] - hf_logprobs(new_model, prompt, gen.token_ids)[before:]).abs().max() < 1e-4


def test_weight_update_during_drain_lets_running_turns_finish_on_the_old_weights(dense):
    """pause("drain") stops nothing; after the update the running turn goes on under version 0 on the old
    weights while a request that arrives meanwhile samples under version 1, in the same engine steps."""
    new_model = perturbed(dense)

    async def body(engine):
        later, both_ran = None, False

        async def after_the_update():
            nonlocal later, both_ran
            later = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6)))
            while not later.done():
                both_ran |= len(engine._running) == 2
                await asyncio.sleep(0)

        task = asyncio.create_task(engine.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=64)))
        while not engine._running or engine._running[0].num_sampled < 4:
            await asyncio.sleep(0)
        await engine.pause("drain")
        await engine.update_weights(new_model.named_parameters(), version=1)
        await engine.resume()
        await after_the_update()
        return await task, await later, both_ran, engine.version, engine._previous

    gen, later, both_ran, version, previous = run_engine(dense, body)
    assert gen.versions == [0] * 64 and gen.token_ids == hf_greedy(dense, PROMPTS[2], 64)
    assert (torch.tensor(gen.logprobs) - hf_logprobs(dense, PROMPTS[2], gen.token_ids)).abs().max() < 1e-4
    assert later.versions == [1] * 6 and later.token_ids == hf_greedy(new_model, PROMPTS[0], 6)
    assert (torch.tensor(later.logprobs) - hf_logprobs(new_model, PROMPTS[0], later.token_ids)).abs().max() < 1e-4
    assert both_ran and version == 1 and previous is None  # the old model is released once its turn ended


def test_update_weights_errors(dense):
    async def body(engine):
        with pytest.raises(RuntimeError, match="pause"):
            await engine.update_weights([], version=1)
        await engine.pause("keep")
        with pytest.raises(KeyError, match="model.nope"):
            await engine.update_weights([("model.nope", torch.zeros(1))], version=1)
        with pytest.raises(ValueError, match=r"model.norm.weight has shape \(64,\)"):
            await engine.update_weights([("model.norm.weight", torch.zeros(3))], version=1)
        # An untied-style state dict (lm_head.weight present) loads too.
        await engine.update_weights(dense.named_parameters(remove_duplicate=False), version=5)
        assert engine.version == 5
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            await engine.generate([1, 99999], SamplingParams())

    run_engine(dense, body)


def test_moe_routing_matches_hf_router(moe, tiny_moe_dir):
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)

    async def main():
        engine = EmbeddedEngine.from_pretrained(tiny_moe_dir, EngineConfig(dtype="float32"))
        try:
            return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS[:3]))
        finally:
            await engine.close()

    gens = asyncio.run(main())
    for prompt, gen in zip(PROMPTS, gens):
        recorded = []
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out, rec=recorded: rec.append(out[2]))
                 for layer in moe.model.layers]
        try:
            expected_logprobs = hf_logprobs(moe, prompt, gen.token_ids)
        finally:
            for h in hooks:
                h.remove()
        expected = torch.stack(recorded, dim=1)[len(prompt):]  # (sampled tokens, layers, top_k)
        assert gen.routed_experts.shape == (8, 2, 2)
        assert torch.equal(gen.routed_experts, expected)
        assert (torch.tensor(gen.logprobs) - expected_logprobs).abs().max() < 1e-4


@pytest.mark.parametrize("enabled", [True, False])
def test_session_prefix_is_reused_across_turns(dense, enabled):
    params = SamplingParams(temperature=0, max_tokens=6)
    observation = [40, 41, 42]

    async def body(engine):
        first = await engine.generate(PROMPTS[3], params, session_id="s")
        prompt2 = PROMPTS[3] + first.token_ids + observation
        second = await engine.generate(prompt2, params, session_id="s")
        return first, prompt2, second, dict(engine.stats)

    first, prompt2, second, stats = run_engine(dense, body, EngineConfig(enable_prefix_caching=enabled))
    assert second.token_ids == hf_greedy(dense, prompt2, 6)
    assert (torch.tensor(second.logprobs) - hf_logprobs(dense, prompt2, second.token_ids)).abs().max() < 1e-4
    # Turn 2 reused the prompt and all but the last sampled token (never fed) of turn 1.
    assert stats["prefix_hit_tokens"] == (len(PROMPTS[3]) + 5 if enabled else 0)
    assert stats["prompt_tokens"] == len(PROMPTS[3]) + len(prompt2)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_group_sharing_one_prompt_computes_it_once(dense, enabled):
    """The samples of a GRPO group arrive together with one prompt: the first computes it, the others copy
    its keys/values and feed only its last token; each samples exactly what it samples alone."""
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=s) for s in range(4)]

    async def body(engine):
        group = await asyncio.gather(*(engine.generate(PROMPTS[2], p) for p in params))
        return group, dict(engine.stats)

    async def alone(engine):
        return [await engine.generate(PROMPTS[2], p) for p in params]

    group, stats = run_engine(dense, body, EngineConfig(enable_prefix_caching=enabled))
    for got, want in zip(group, run_engine(dense, alone), strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert stats["prefix_hit_tokens"] == (3 * (len(PROMPTS[2]) - 1) if enabled else 0)
    assert len({tuple(g.token_ids) for g in group}) > 1  # four seeds, not one sample four times


def test_a_group_whose_first_sample_ends_at_once_still_shares_its_prompt_exactly(dense):
    """The group's first request computes the prompt and may end at its first token (max_tokens=1, or a
    stop token); the others then still copy its keys/values, not those of the slot it leaves."""
    async def body(engine):  # sixteen other prompts first: every slot of the cache holds other keys
        await asyncio.gather(*(engine.generate([5 + i, *PROMPTS[1]], SamplingParams(max_tokens=4)) for i in range(16)))
        first = engine.generate(PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=1, seed=0))
        rest = [engine.generate(PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=3, seed=s)) for s in (1, 2, 3)]
        return await asyncio.gather(first, *rest), dict(engine.stats)

    group, stats = run_engine(dense, body)
    assert stats["prefix_hit_tokens"] == 3 * (len(PROMPTS[2]) - 1)  # the three did copy the first's prompt
    for g in group:
        assert g.logprobs == pytest.approx(hf_logprobs(dense, PROMPTS[2], g.token_ids).tolist(), abs=1e-5)


def test_short_request_joins_and_leaves_a_running_batch(dense):
    async def body(engine):
        long = asyncio.create_task(engine.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=40)))
        while not engine._running or engine._running[0].num_sampled < 5:
            await asyncio.sleep(0)
        short = await engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
        return short, long.done(), await long

    short, long_was_done, long = run_engine(dense, body)
    assert not long_was_done
    assert short.token_ids == hf_greedy(dense, PROMPTS[0], 3)
    assert long.token_ids == hf_greedy(dense, PROMPTS[3], 40)


@pytest.mark.parametrize("device", DEVICES)
def test_requests_leaving_from_the_middle_keep_the_others_exact(dense, device):
    """Requests that finish early free slots among running ones; the engine moves the last running
    request into the hole (its cached keys with it), and a request that arrives later joins at the end:
    every turn still equals HF's greedy decode of its own prompt, and the running slots stay 0..R-1."""
    lengths = [3, 30, 7, 30, 1, 30, 12, 30]
    slots_seen = []

    async def body(engine):
        first = [asyncio.create_task(engine.generate(PROMPTS[i % 4], SamplingParams(temperature=0, max_tokens=n)))
                 for i, n in enumerate(lengths)]
        while engine.stats["sampled_tokens"] < 90:  # the short ones have left, the long ones run on
            slots_seen.append(sorted(r.slot for r in engine._running))
            await asyncio.sleep(0)
        late = await engine.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6))
        return await asyncio.gather(*first), late

    first, late = run_engine(dense, body, device=device)
    for i, (n, gen) in enumerate(zip(lengths, first)):
        assert gen.token_ids == hf_greedy(dense, PROMPTS[i % 4], n)
        assert torch.allclose(torch.tensor(gen.logprobs), hf_logprobs(dense, PROMPTS[i % 4], gen.token_ids), atol=1e-4)
    assert late.token_ids == hf_greedy(dense, PROMPTS[1], 6)
    assert all(s == list(range(len(s))) for s in slots_seen)
    assert {8, 4} <= {len(s) for s in slots_seen}  # all eight ran, then the four short ones left


def test_pause_abort_and_drain(dense):
    async def body(engine):
        running = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=50, seed=0)))
        while not engine._running or engine._running[0].num_sampled < 3:
            await asyncio.sleep(0)
        await engine.pause("abort")
        aborted = await running
        queued = asyncio.create_task(engine.generate(PROMPTS[1], SamplingParams(max_tokens=4, seed=0)))
        await asyncio.sleep(0.01)
        assert engine.load().queued == 1 and not queued.done()  # paused: it waits for resume
        await engine.resume()
        first = asyncio.create_task(engine.generate(PROMPTS[2], SamplingParams(max_tokens=6, seed=0)))
        while engine.load().running < 2:
            await asyncio.sleep(0)
        await engine.pause("drain")  # stops nothing (before an update): running requests go on, new ones start
        late = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=2, seed=0)))
        await asyncio.wait([first, queued, late], timeout=30)
        waited = first.done() and queued.done()
        late_waits = not late.done()
        await engine.resume()
        return aborted, waited, late_waits, await first, await late

    aborted, waited, late_waits, first, late = run_engine(dense, body)
    assert aborted.finish_reason == "abort" and 3 <= len(aborted.token_ids) < 50
    assert len(aborted.logprobs) == len(aborted.versions) == len(aborted.token_ids)
    assert waited and not late_waits
    assert first.finish_reason == "length" and len(first.token_ids) == 6
    assert len(late.token_ids) == 2


def test_scheduler_failure_reaches_every_waiter(dense):
    async def body(engine):
        def broken(group):
            raise RuntimeError("boom")
        engine._run = broken  # stands in for any failure inside a step (e.g. out of memory)
        results = await asyncio.gather(*(engine.generate(p, SamplingParams()) for p in PROMPTS),
                                       return_exceptions=True)
        with pytest.raises(RuntimeError, match="failed earlier"):
            await engine.generate(PROMPTS[0], SamplingParams())
        return results

    results = run_engine(dense, body)
    assert [str(r) for r in results] == ["boom"] * len(PROMPTS)


def test_closed_engine_refuses_requests(dense):
    async def main():
        engine = EmbeddedEngine(copy.deepcopy(dense))
        await engine.generate(PROMPTS[0], SamplingParams(max_tokens=2))
        await engine.close()
        with pytest.raises(RuntimeError, match="closed engine"):
            await engine.generate(PROMPTS[0], SamplingParams())

    asyncio.run(main())


def test_the_rotary_table_holds_hfs_values_at_every_position(dense):
    """A step looks its rotary cos / sin up in a table of every cached position: exactly what HF computes
    for those positions in the step, before and after the cache (and so the table) grows."""
    from instar.engines import kv_model as km
    emb = km.decoder(dense).rotary_emb
    assert emb.rope_type in km.STATIC_ROPE
    cache = km.SlotCache(dense, 2, 16)
    h = torch.zeros(3, dense.config.hidden_size)
    for positions in (torch.tensor([0, 7, 15]), torch.tensor([3, 40, 63])):
        cache.reserve(int(positions.max()) + 1)
        table = km._rotary_table(emb, h, cache)
        assert table[0].shape[0] == cache.shape[2] >= 64 or positions.max() < 16
        want = km._rotary(emb, h, positions[None])
        for got, expected in zip(table, want):
            assert torch.equal(got[positions], expected)


def test_slot_copies_move_each_slots_first_positions_and_nothing_else(dense):
    """`SlotCache.copy` does a step's moves of several lengths in one indexed copy per layer and length: each
    slot gets its source's first positions, every other position of every slot stays as it was."""
    from instar.engines import kv_model as km
    cache = km.SlotCache(dense, 6, 8)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape))
    before = [t.clone() for t in (*cache.k, *cache.v)]
    cache.copy([(0, 3, 5), (1, 4, 2), (2, 5, 5)])
    for got, old in zip((*cache.k, *cache.v), before):
        want = old.clone()
        want[3, :, :5], want[4, :, :2], want[5, :, :5] = old[0, :, :5], old[1, :, :2], old[2, :, :5]
        assert torch.equal(got, want)

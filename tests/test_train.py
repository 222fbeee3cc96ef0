"""Trainer building blocks in one process: micro-batch planning, packed logprobs, LR schedule,
MoE routing replay and the frozen router. Multi-rank behaviour is in test_train_fsdp.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from instar.contract import Sample
from instar.train.batch import StepInputs, collate, plan_micro_batches, shard_samples
from instar.train.model import forward_logits, load_model, next_token_logprobs
from instar.train.moe import freeze_routers, record_routes, replay_routes, routers
from instar.train.optim import build_optimizer, lr_factor


def make_sample(n: int, seed: int, vocab: int = 500) -> Sample:
    ids = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    return Sample(ids, mask, [-1.0 if m else 0.0 for m in mask], [0 if m else -1 for m in mask])


def test_plan_is_first_fit_decreasing_under_the_budget():
    assert plan_micro_batches([5, 9, 3, 7, 2], 10) == [[1], [3, 2], [0, 4]]
    assert plan_micro_batches([5, 9, 3, 7, 2], 100) == [[1, 3, 0, 2, 4]]
    assert plan_micro_batches([], 10) == []


def test_plan_rejects_a_sample_longer_than_the_budget():
    with pytest.raises(ValueError, match="has 12 tokens, more than --train.max_tokens_per_gpu 10"):
        plan_micro_batches([5, 12], 10)


def test_shard_samples_balances_tokens_over_ranks():
    assert shard_samples([5, 9, 3, 7, 2], 2) == [[1, 2, 4], [0, 3]]
    assert shard_samples([4, 4, 4], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="2 samples cannot feed 3 trainer ranks"):
        shard_samples([1, 2], 3)


def test_collate_packs_one_row_and_unpacks_right_padded():
    samples = [make_sample(4, 0), make_sample(2, 1)]
    mb = collate(samples, [1, 0], StepInputs(advantages=[torch.full((4,), 0.5), torch.full((2,), -1.0)]))
    assert mb.input_ids.tolist() == [samples[1].token_ids + samples[0].token_ids]
    assert mb.position_ids.tolist() == [[0, 1, 0, 1, 2, 3]]
    assert mb.inputs.action_mask.tolist() == [[False, True, False, False], [False, False, True, True]]
    assert mb.inputs.advantages.tolist() == [[-1.0, -1.0, 0.0, 0.0], [0.5] * 4]
    assert mb.inputs.returns is None and mb.inputs.lengths.tolist() == [2, 4]
    # token t of a sample takes the row value at position t-1; t = 0 and padding are 0
    assert mb.unpack(torch.arange(6.0) + 10).tolist() == [[0, 10, 0, 0], [0, 12, 13, 14]]


@pytest.mark.parametrize("attention", ["packed", "sdpa"])
def test_packed_logprobs_equal_one_forward_per_sample(tiny_model_dir, attention):
    # "packed": instar's per-sequence attention (what load_model uses); "sdpa": transformers' own
    # block-diagonal mask built from the restarting position_ids.
    load = load_model if attention == "packed" else AutoModelForCausalLM.from_pretrained
    model = load(tiny_model_dir)
    samples = [make_sample(n, i) for i, n in enumerate([7, 12, 5])]
    mb = collate(samples, [0, 1, 2])
    with torch.no_grad():
        logp, entropy = next_token_logprobs(forward_logits(model, mb.input_ids, mb.position_ids), mb.input_ids)
        per_sample = mb.split(mb.unpack(logp))
        for s, lp in zip(samples, per_sample):
            ids = torch.tensor([s.token_ids])
            ref = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            assert lp.shape == (len(s.token_ids),) and lp[0] == 0
            torch.testing.assert_close(lp[1:], ref, atol=2e-6, rtol=0)
    assert entropy.shape == (24,) and bool((entropy > 0).all())


def test_packed_attention_gradients_match_transformers_masked_attention(tiny_model_dir):
    packed, masked = load_model(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert packed.config._attn_implementation == "instar_packed"
    mb = collate([make_sample(n, i) for i, n in enumerate([9, 30, 4, 17])], [0, 1, 2, 3])
    for model in (packed, masked):
        logp, _ = next_token_logprobs(forward_logits(model, mb.input_ids, mb.position_ids), mb.input_ids)
        mb.unpack(logp).sum().backward()
    for (name, a), b in zip(packed.named_parameters(), masked.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_lr_schedule_warms_up_then_decays():
    assert [lr_factor(s, 3, 10, "constant") for s in (0, 1, 2, 3, 9)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert [round(lr_factor(s, 2, 10, "linear"), 4) for s in (2, 6, 10)] == [1.0, 0.5, 0.0]
    assert [round(lr_factor(s, 0, 4, "cosine"), 4) for s in (0, 2, 4)] == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="unknown --actor.lr_scheduler 'step'"):
        lr_factor(5, 0, 10, "step")


def _router_step(model, ids):
    """One optimizer step that changes only the router weights (as a trainer step would, without a
    weight sync to the engine that recorded the routes)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for r in routers(model):
        r.weight.requires_grad_(True)
    opt = torch.optim.SGD([r.weight for r in routers(model)], lr=0.2)
    out = model(input_ids=ids).logits
    torch.log_softmax(out, -1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().backward()
    opt.step()


def test_routing_replay_follows_the_recorded_routes(tiny_moe_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    ids = torch.tensor([make_sample(24, 3).token_ids])
    with torch.no_grad(), record_routes(model) as rec:
        before = next_token_logprobs(model(input_ids=ids).logits, ids)[0]
    recorded = rec[0]
    assert recorded.shape == (24, 2, 2)
    with torch.no_grad(), replay_routes(model, recorded):  # same weights: replay is exactly a no-op
        torch.testing.assert_close(next_token_logprobs(model(input_ids=ids).logits, ids)[0], before,
                                   atol=1e-6, rtol=0)
    _router_step(model, ids)
    with torch.no_grad():
        with record_routes(model) as free:
            drifted = next_token_logprobs(model(input_ids=ids).logits, ids)[0]
        with replay_routes(model, recorded), record_routes(model) as replayed:
            replay = next_token_logprobs(model(input_ids=ids).logits, ids)[0]
    changed = (free[0].sort(-1).values != recorded.sort(-1).values).any(-1).float().mean().item()
    assert changed > 0.2  # without replay the new router picks other experts for many tokens
    assert torch.equal(replayed[0], recorded)  # hooks run in order: the recorder sees the replayed routes
    gap_free = (drifted - before)[:-1].abs().mean().item()
    gap_replay = (replay - before)[:-1].abs().mean().item()
    assert gap_replay < 0.5 * gap_free  # what remains is the new routing weights of the same experts


def test_replay_keeps_own_routes_where_none_were_recorded(tiny_moe_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    ids = torch.tensor([make_sample(10, 4).token_ids])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with replay_routes(model, torch.full((10, 2, 2), -1)):
            same = model(input_ids=ids).logits
    torch.testing.assert_close(same, plain, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"routed_experts must be \[tokens, 2 moe layers, top_k\]"):
        with replay_routes(model, torch.zeros(10, 3, 2, dtype=torch.long)):
            pass


def test_frozen_router_keeps_its_weights(tiny_moe_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    assert freeze_routers(model) == 2
    opt = build_optimizer(model, lr=1e-2)
    gate0 = routers(model)[0].weight.detach().clone()
    embed0 = model.model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([make_sample(12, 5).token_ids])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert torch.equal(routers(model)[0].weight, gate0)
    assert not torch.equal(model.model.embed_tokens.weight, embed0)

"""Trainer building blocks in one process: micro-batch planning, packed logprobs, LR schedule,
MoE routing replay and the frozen router. Multi-rank behaviour is in test_train_fsdp.py."""

import math

import pytest
import torch
from helpers.routes import record_routes
from transformers import AutoModelForCausalLM

from instar.contract import Sample
from instar.train.batch import StepInputs, collate, plan_micro_batches, shard_samples
from instar.train.model import ChunkedLogprobs, forward_logits, load_model, next_token_logprobs, token_logprobs
from instar.train.moe import freeze_routers, replay_routes, routers
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
    # work, not tokens: sample 0 runs forward only (cost 1), 1 and 2 backward too (cost 3)
    assert shard_samples([20, 10, 10], 2) == [[0], [1, 2]]  # 20 and 20 tokens: work 20 and 60
    assert shard_samples([20, 10, 10], 2, cost=[1, 3, 3]) == [[0, 1], [2]]  # work 50 and 30
    assert shard_samples([20, 10, 10], 2, cost=[3, 3, 3]) == [[0], [1, 2]]  # one cost for all: tokens


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


def _full_softmax(logits, targets, temperature, with_entropy):
    """The unchunked formula: one float32 log-softmax over all rows, entropy through autograd."""
    logp = torch.log_softmax(logits[0].float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_chunked_logprobs_equal_one_full_softmax(dtype, temperature, with_entropy):
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 50, (40,), generator=gen)
    logits = (3 * torch.randn(1, 40, 50, generator=gen)).to(dtype).requires_grad_()
    w_logp, w_entropy = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    chunked = token_logprobs(logits, targets, temperature, with_entropy, chunk_tokens=7)  # 7 does not divide 40
    full = _full_softmax(logits, targets, temperature, with_entropy)
    # the same float32 arithmetic per row: chunking changes no value
    assert torch.equal(chunked[0], full[0])
    assert torch.equal(chunked[1], full[1]) if with_entropy else chunked[1] is None
    grads = [torch.autograd.grad(logp @ w_logp + (entropy @ w_entropy if with_entropy else 0), logits)[0]
             for logp, entropy in (chunked, full)]
    assert grads[0].dtype == dtype
    # float32: the hand-written gradient sums in another order than autograd's; bfloat16: one rounding
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(grads[0], grads[1], **tol)


def test_chunked_logprob_gradients_pass_gradcheck():
    logits = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 5, (7,), generator=torch.Generator().manual_seed(1))
    # both outputs, then each alone (the other's gradient is None: its term is skipped)
    assert torch.autograd.gradcheck(lambda x: ChunkedLogprobs.apply(x, target, 0.7, True, 3), (logits,))
    assert torch.autograd.gradcheck(lambda x: ChunkedLogprobs.apply(x, target, 0.7, True, 3)[1], (logits,))
    assert torch.autograd.gradcheck(lambda x: ChunkedLogprobs.apply(x, target, 1.3, False, 3)[0], (logits,))


def test_logprob_and_entropy_golden_values():
    # logits / temperature = [0, ln 3]: p = [1/4, 3/4]
    logits = torch.tensor([[[0.0, 2 * math.log(3)]]], requires_grad=True)
    logp, entropy = next_token_logprobs(logits, torch.tensor([[1]]), temperature=2.0)
    assert logp.item() == pytest.approx(math.log(0.75), abs=1e-7)
    assert entropy.item() == pytest.approx(0.5623351446188083, abs=1e-7)  # -(1/4 ln 1/4 + 3/4 ln 3/4)
    (g_logp,) = torch.autograd.grad(logp.sum(), logits, retain_graph=True)
    assert g_logp[0, 0].tolist() == pytest.approx([-0.125, 0.125], abs=1e-7)  # (onehot - p) / T
    (g_entropy,) = torch.autograd.grad(entropy.sum(), logits)
    assert g_entropy[0, 0].tolist() == pytest.approx([0.10299490206263529, -0.10299490206263527], abs=1e-7)


def test_logprob_backward_keeps_no_vocab_sized_tensor_but_the_logits():
    logits = torch.randn(1, 64, 300, requires_grad=True)
    saved = []

    def keep(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logp, entropy = token_logprobs(logits, torch.randint(0, 300, (64,)), 0.9, chunk_tokens=16)
    big = [t for t in saved if t.numel() >= 64 * 300]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr() and big[0].dtype == logits.dtype
    assert max(t.numel() for t in saved if t is not big[0]) == 64  # per-row targets and entropies


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
    freeze_routers(model)
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == [f"model.layers.{i}.mlp.gate.weight"
                                                                              for i in range(2)]
    opt = build_optimizer(model, lr=1e-2)
    gate0 = routers(model)[0].weight.detach().clone()
    embed0 = model.model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([make_sample(12, 5).token_ids])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert torch.equal(routers(model)[0].weight, gate0)
    assert not torch.equal(model.model.embed_tokens.weight, embed0)


def test_step_inputs_travel_as_one_tensor_per_field_and_come_back_equal():
    import pickle

    inputs = StepInputs(advantages=[torch.randn(n) for n in (3, 7, 1)], old_logprobs=[], returns=None)
    wire = pickle.dumps(inputs, protocol=5)
    back = pickle.loads(wire)
    assert [t.tolist() for t in back.advantages] == [t.tolist() for t in inputs.advantages]
    assert back.old_logprobs == [] and back.ref_logprobs is None and back.returns is None
    flat, lengths = inputs.__reduce__()[1][0]  # the advantages travel as one tensor and their lengths
    assert flat.shape == (11,) and lengths == [3, 7, 1]

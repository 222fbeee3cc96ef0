"""The trainer ranks as real processes over gloo: 2-rank FSDP2 equals 1-rank training, micro-batch
splits do not change the update, a sharded checkpoint resumes in a fresh process to the same next
step, and the HF export loads in transformers with the trainer's logprobs."""

import time
from functools import partial

import pytest
import torch
from helpers.layouts import full
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

from instar.config import ActorConfig, CriticConfig, FSDPConfig, RLConfig, TrainConfig
from instar.contract import Sample
from instar.runtime.batching import critic_loss, rl_loss
from instar.train import checkpoint
from instar.train.batch import StepInputs
from instar.train.launch import reserve_port, run_ranks
from instar.train.worker import TrainWorker

LENGTHS = [7, 12, 5, 9, 3, 10, 4]
RL = RLConfig()  # ppo, no KL; token-level truncated IS (the samples' rollout logprobs are made up)
RL.algo.advantage.is_correction_level, RL.algo.advantage.is_correction_mode = "token", "trunc"
LOSS = partial(rl_loss, RL, 0.0)


def make_sample(n: int, seed: int) -> Sample:
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    return Sample(ids, mask, [-1.0 if m else 0.0 for m in mask], [0 if m else -1 for m in mask])


SAMPLES = [make_sample(n, i) for i, n in enumerate(LENGTHS)]


def _worker(model_dir, rank, world, port, max_tokens, **kwargs) -> TrainWorker:
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir), learning_rate=1e-3, lr_warmup_steps=1),
                    FSDPConfig(num_ranks=world), TrainConfig(max_tokens_per_gpu=max_tokens, max_steps=10), **kwargs)
    w.init(rank, world, "127.0.0.1", port)
    return w


def _rl_step(w: TrainWorker) -> dict[str, float]:
    """One on-policy PPO step on SAMPLES (advantage +1 / -1 by sample); each rank takes its share."""
    adv = [torch.full((n,), 1.0 if i % 2 else -1.0) for i, n in enumerate(LENGTHS)]
    return w.train_policy(SAMPLES, LOSS, StepInputs(advantages=adv)).metrics


def _full_state(w: TrainWorker) -> dict[str, torch.Tensor]:
    return get_model_state_dict(w.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _one_rank_job(rank, world, port, model_dir):
    w = _worker(model_dir, rank, world, port, 64, critic=CriticConfig(learning_rate=1e-2), ref_path=str(model_dir))
    initial = w.compute_logprobs(SAMPLES)
    metrics = [_rl_step(w) for _ in range(3)]
    out = {"metrics": metrics, "state": _full_state(w), "logprobs": w.compute_logprobs(SAMPLES), "initial": initial,
           "ref": w.compute_logprobs(SAMPLES, model="ref")}
    returns = [torch.full((n,), 0.5) for n in LENGTHS]
    values = w.compute_values(SAMPLES)
    out["values0"] = values
    out["critic"] = [w.train_critic(SAMPLES, partial(critic_loss, RL),
                                    StepInputs(old_values=w.compute_values(SAMPLES), returns=returns)).metrics
                     for _ in range(3)]
    out["split"] = {}
    for max_tokens in (12, 64):  # the same batch as 5 micro-batches or as 1
        w2 = _worker(model_dir, rank, world, port, max_tokens)
        out["split"][max_tokens] = (_rl_step(w2), _full_state(w2))
    w.shutdown()
    return out


def _two_rank_job(rank, world, port, model_dir, ckpt_dir, export_dir):
    w = _worker(model_dir, rank, world, port, 12)
    metrics = [_rl_step(w), _rl_step(w)]
    t0 = time.perf_counter()
    w.save(ckpt_dir, {"note": "after two steps"}, max_num=2)
    save_s = time.perf_counter() - t0
    metrics.append(_rl_step(w))
    out = {"metrics": metrics, "state": _full_state(w), "logprobs": w.compute_logprobs(SAMPLES), "save_s": save_s}
    w.export_hf(export_dir)
    w.shutdown()
    return out


def _resume_job(rank, world, port, model_dir, ckpt_dir):
    w = _worker(model_dir, rank, world, port, 12)
    t0 = time.perf_counter()
    extra = w.load(checkpoint.latest(ckpt_dir))
    load_s = time.perf_counter() - t0
    out = {"extra": extra, "step_before": w.step, "metrics": _rl_step(w), "state": _full_state(w), "load_s": load_s}
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir):
    """One rank runs in this process (saves a process start); the job destroys its process group."""
    return _one_rank_job(0, 1, reserve_port(), tiny_model_dir)


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("two_ranks")
    results = run_ranks(_two_rank_job, 2, tiny_model_dir, str(d / "ckpt"), str(d / "hf"))
    return results, d


def _assert_same_training(a: dict, b: dict) -> None:
    for k in a:
        diff = (a[k] - b[k]).abs()
        # Adam turns float noise in near-zero gradients into ~lr-sized steps on a handful of entries
        assert diff.max() < 1e-4, k
        assert (diff > 1e-6).float().mean() < 1e-3, k


def test_two_ranks_equal_one_rank_after_three_steps(one_rank, two_ranks):
    results, _ = two_ranks
    for step in range(3):
        m1, m2 = one_rank["metrics"][step], results[0]["metrics"][step]
        assert m2["actor/samples"] == m1["actor/samples"] == 7 and m2["actor/action_tokens"] == 27
        assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
        assert m2["actor/entropy"] == pytest.approx(m1["actor/entropy"], rel=1e-5)
        assert m2["actor/lr"] == m1["actor/lr"] == [5e-4, 1e-3, 1e-3][step]
    assert results[0]["metrics"][0]["actor/micro_batches"] == 5  # rank 1 ran 3 passes, rank 0 two (+1 repeat)
    _assert_same_training(one_rank["state"], results[0]["state"])
    for a, b in zip(one_rank["logprobs"], results[1]["logprobs"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(one_rank["logprobs"], one_rank["initial"]))


def test_micro_batch_split_gives_the_same_update(one_rank):
    (m5, s5), (m1, s1) = one_rank["split"][12], one_rank["split"][64]
    assert (m5["actor/micro_batches"], m1["actor/micro_batches"]) == (5, 1)
    assert m5["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
    _assert_same_training(s5, s1)


def test_reference_stays_frozen_and_critic_learns(one_rank):
    for ref, init in zip(one_rank["ref"], one_rank["initial"]):
        torch.testing.assert_close(ref, init, atol=1e-6, rtol=0)
    assert all(v.shape == (n,) and bool((v == 0).all()) for v, n in zip(one_rank["values0"], LENGTHS))
    losses = [m["critic/value_loss"] for m in one_rank["critic"]]
    assert losses[0] == pytest.approx(0.125)  # 0.5 * (0 - 0.5)^2 while the value head is zero
    assert losses[0] > losses[1] > losses[2] and losses[2] < 0.7 * losses[0]


def test_resume_in_a_fresh_process_gives_the_same_next_step(two_ranks, tiny_model_dir):
    results, d = two_ranks
    resumed = run_ranks(_resume_job, 2, tiny_model_dir, str(d / "ckpt"))
    assert resumed[0]["extra"] == {"note": "after two steps"} and resumed[0]["step_before"] == 2
    uninterrupted = results[0]["metrics"][2]
    assert resumed[0]["metrics"]["actor/grad_norm"] == pytest.approx(uninterrupted["actor/grad_norm"], rel=1e-6)
    assert resumed[0]["metrics"]["actor/lr"] == uninterrupted["actor/lr"]
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(resumed[0]["state"][k], v, atol=1e-7, rtol=0)


def test_hf_export_loads_in_transformers_with_the_trainers_logprobs(two_ranks):
    results, d = two_ranks
    model = AutoModelForCausalLM.from_pretrained(d / "hf")
    state = model.state_dict()
    for k, v in results[0]["state"].items():
        assert torch.equal(state[k], v), k
    for s, lp in zip(SAMPLES, results[0]["logprobs"]):
        ids = torch.tensor([s.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(lp[1:], ref, atol=1e-5, rtol=0)
    assert (d / "hf" / "tokenizer.json").exists() and not (d / "hf.tmp").exists()


def test_worker_replays_recorded_routes_and_freezes_the_router(tiny_moe_dir):
    from helpers.routes import record_routes

    from instar.train.moe import routers

    w = TrainWorker(ActorConfig(model_name_or_path=str(tiny_moe_dir), learning_rate=1e-2, freeze_moe_router=True),
                    FSDPConfig(num_ranks=1), TrainConfig(max_tokens_per_gpu=64, routing_replay=True))
    w.init(0, 1, "127.0.0.1", reserve_port())
    try:
        sample = make_sample(12, 0)
        with pytest.raises(ValueError, match="some samples carry no routed_experts"):
            w.compute_logprobs([sample])
        with record_routes(w.policy) as rec:
            w.compute_logprobs([Sample(**{**sample.__dict__, "routed_experts": torch.full((12, 2, 2), -1)})])
        own = Sample(**{**sample.__dict__, "routed_experts": rec[0]})
        other = Sample(**{**sample.__dict__, "routed_experts": (rec[0] + 1) % 4})
        with_own, with_other = w.compute_logprobs([own, other])
        w.train.routing_replay = False
        plain = w.compute_logprobs([sample])[0]
        torch.testing.assert_close(with_own, plain, atol=1e-6, rtol=0)  # own routes: replay is a no-op
        assert (with_other - plain).abs().max() > 1e-3  # other experts, other logprobs
        w.train.routing_replay = True
        gates = [full(r.weight).clone() for r in routers(w.policy)]
        adv = [torch.ones(12)]
        w.train_policy([own], LOSS, StepInputs(advantages=adv, old_logprobs=[with_own]))
        assert all(torch.equal(full(r.weight), g) for r, g in zip(routers(w.policy), gates))
        assert (w.compute_logprobs([own])[0] - with_own).abs().max() > 1e-4  # the rest of the model moved
    finally:
        w.shutdown()


def test_optimizer_offload_and_activation_checkpointing_change_nothing(one_rank, tiny_model_dir):
    w = TrainWorker(ActorConfig(model_name_or_path=str(tiny_model_dir), learning_rate=1e-3, lr_warmup_steps=1),
                    FSDPConfig(num_ranks=1, offload="optimizer", activation_checkpointing=True),
                    TrainConfig(max_tokens_per_gpu=64, max_steps=10))
    w.init(0, 1, "127.0.0.1", reserve_port())
    try:
        metrics = _rl_step(w)
        state = _full_state(w)
    finally:
        w.shutdown()
    plain_metrics, plain_state = one_rank["split"][64]
    assert metrics["actor/grad_norm"] == pytest.approx(plain_metrics["actor/grad_norm"], rel=1e-5)
    _assert_same_training(state, plain_state)

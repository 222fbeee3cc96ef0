"""Expert parallelism over gloo equals one rank: ep=2 (and ep=2 x dp=2) give the same logprobs, loss,
grad norm and weights as a single rank after 3 steps on the tiny MoE; routing replay (R3) and frozen
routers work unchanged under EP; a checkpoint saved with EP resumes in another layout to the same
next step; impossible layouts are refused naming the fix."""

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from instar.checks import check_layout
from instar.config import ActorConfig, ConfigError, FSDPConfig, RLConfig, TrainConfig
from instar.contract import Sample
from instar.runtime.batching import rl_loss
from instar.train import checkpoint
from instar.train.batch import StepInputs
from instar.train.launch import free_port, run_ranks
from instar.train.model import forward_logits
from instar.train.moe import record_routes, replay_routes, routers
from instar.train.worker import TrainWorker

LENGTHS = [7, 12, 5, 9, 3, 10, 4, 8]
RL = RLConfig()
RL.algo.advantage.is_correction_level, RL.algo.advantage.is_correction_mode = "token", "trunc"
TOL = {"rtol": 1e-4, "atol": 1e-5}  # float32 sums in another order (per-expert matmuls, all-to-alls)


def make_sample(n: int, seed: int) -> Sample:
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    # R3 routes unlike the router's own: 2 distinct of the 4 experts per token and layer, at random
    routes = torch.rand(n, 2, 4, generator=torch.Generator().manual_seed(100 + seed)).argsort(-1)[..., :2]
    return Sample(ids, mask, [-1.0 if m else 0.0 for m in mask], [0 if m else -1 for m in mask], routes)


SAMPLES = [make_sample(n, i) for i, n in enumerate(LENGTHS)]
ADVANTAGES = [torch.full((n,), 1.0 if i % 2 else -1.0) for i, n in enumerate(LENGTHS)]


def _worker(model_dir, rank, world, port, ep, replay=False) -> TrainWorker:
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir), learning_rate=1e-3, lr_warmup_steps=1,
                                freeze_moe_router=replay),
                    FSDPConfig(num_ranks=world, ep_size=ep),
                    TrainConfig(max_tokens_per_gpu=24, max_steps=10, routing_replay=replay))
    w.init(rank, world, "127.0.0.1", port)
    return w


def _step(w: TrainWorker) -> dict[str, float]:
    return w.train_step(SAMPLES, partial(rl_loss, RL, 0.0), StepInputs(advantages=ADVANTAGES))


def _state(w: TrainWorker) -> dict[str, torch.Tensor]:
    return get_model_state_dict(w.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _train_job(rank, world, port, model_dir, ep, ckpt_dir):
    w = _worker(model_dir, rank, world, port, ep)
    out = {"initial": w.compute_logprobs(SAMPLES), "metrics": [_step(w), _step(w)]}
    if ckpt_dir:
        w.save(ckpt_dir, {"layout": (world, ep)})
    out["metrics"].append(_step(w))
    out |= {"state": _state(w), "logprobs": w.compute_logprobs(SAMPLES)}
    w.shutdown()
    return out


def _resume_job(rank, world, port, model_dir, ep, ckpt_dir):
    w = _worker(model_dir, rank, world, port, ep)
    extra = w.load(checkpoint.latest(ckpt_dir))
    out = {"extra": extra, "metrics": _step(w), "state": _state(w)}
    w.shutdown()
    return out


def _replay_job(rank, world, port, model_dir, ep):
    """Logprobs under R3, and what the routers chose while replaying this rank's own samples (every
    rank runs as many forwards: the all-to-alls pair them up), then a step with frozen routers."""
    w = _worker(model_dir, rank, world, port, ep, replay=True)
    out = {"logprobs": w.compute_logprobs(SAMPLES), "recorded": []}
    for s in SAMPLES[rank::world]:
        ids = torch.tensor([s.token_ids])
        with torch.no_grad(), replay_routes(w.policy, s.routed_experts), record_routes(w.policy) as rec:
            forward_logits(w.policy, ids, torch.arange(ids.shape[1])[None])
        out["recorded"].append((s.routed_experts, rec[0]))
    gates = [r.weight.full_tensor().clone() for r in routers(w.policy)]
    out["metrics"] = _step(w)
    out["routers_frozen"] = all(torch.equal(r.weight.full_tensor(), g) for r, g in zip(routers(w.policy), gates))
    out["after"] = w.compute_logprobs(SAMPLES)
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def one_rank(tiny_moe_dir):
    return _train_job(0, 1, free_port(), tiny_moe_dir, 1, None)


def assert_same(a: dict, b: dict) -> None:
    for got, want in zip(a["initial"] + a["logprobs"], b["initial"] + b["logprobs"], strict=True):
        torch.testing.assert_close(got, want, **TOL)
    for m, r in zip(a["metrics"], b["metrics"], strict=True):
        for k in ("actor/loss", "actor/grad_norm", "actor/policy_clip_ratio", "actor/entropy"):
            assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-6), k
    assert a["state"].keys() == b["state"].keys()
    for k in b["state"]:
        torch.testing.assert_close(a["state"][k], b["state"][k], **TOL, msg=k)


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2)], ids=["ep2", "ep2xdp2"])
def test_expert_parallel_equals_one_rank(tiny_moe_dir, one_rank, tmp_path, world, ep):
    ckpt = str(tmp_path / "ckpt")
    results = run_ranks(_train_job, world, tiny_moe_dir, ep, ckpt, timeout=600)
    assert_same(results[0], one_rank)  # the full state dict is gathered on rank 0
    for r in results[1:]:  # every rank computes the same logprobs and metrics
        assert_same({**r, "state": results[0]["state"]}, one_rank)
    # The checkpoint of step 2 resumes at one rank and at another 2-rank layout (ep=2 from ep=2 x dp=2,
    # dp=2 from ep=2) to the same step 3
    resumed = [_resume_job(0, 1, free_port(), tiny_moe_dir, 1, ckpt),
               run_ranks(_resume_job, 2, tiny_moe_dir, 2 if world == 4 else 1, ckpt, timeout=600)[0]]
    for r in resumed:
        assert r["extra"] == {"layout": (world, ep)}
        assert r["metrics"]["actor/loss"] == pytest.approx(one_rank["metrics"][2]["actor/loss"], rel=1e-4)
        for k in one_rank["state"]:
            torch.testing.assert_close(r["state"][k], one_rank["state"][k], **TOL, msg=k)


def test_routing_replay_and_frozen_routers_under_expert_parallel(tiny_moe_dir):
    want = _replay_job(0, 1, free_port(), tiny_moe_dir, 1)
    results = run_ranks(_replay_job, 2, tiny_moe_dir, 2, timeout=600)
    for r in results:
        for replayed, recorded in r["recorded"]:
            assert torch.equal(recorded, replayed)  # the experts that ran are exactly the replayed ones
        assert r["routers_frozen"]
        for got, ref in zip(r["logprobs"] + r["after"], want["logprobs"] + want["after"], strict=True):
            torch.testing.assert_close(got, ref, **TOL)
        assert r["metrics"]["actor/grad_norm"] == pytest.approx(want["metrics"]["actor/grad_norm"], rel=1e-4)
    # the replayed routes are not the router's own: without replay the logprobs differ
    assert max((a - b).abs().max() for a, b in zip(want["logprobs"], _own_routes(tiny_moe_dir))) > 1e-3


def _own_routes(model_dir) -> list[torch.Tensor]:
    w = _worker(model_dir, 0, 1, free_port(), 1)
    try:
        return w.compute_logprobs(SAMPLES)
    finally:
        w.shutdown()


@pytest.mark.parametrize("fsdp, experts, fragment", [
    (FSDPConfig(num_ranks=2, ep_size=2), 3, "--fsdp.ep_size 2 must divide the model's experts (3)"),
    (FSDPConfig(num_ranks=2, ep_size=2), None, "must divide the model's experts (none: a dense model)"),
    (FSDPConfig(num_ranks=3, ep_size=2), 4, "--fsdp.ep_size 2 must divide the data-parallel ranks"),
    (FSDPConfig(num_ranks=4, ep_size=4, tp_size=2), 4, "use --fsdp.num_ranks 8 or a smaller --fsdp.ep_size"),
])
def test_impossible_expert_layouts_name_the_fix(fsdp, experts, fragment):
    model = type("Config", (), {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": experts})()
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_layout(fsdp, model)


@pytest.mark.slow
def test_rl_runs_two_steps_with_expert_parallel_ranks(tmp_path, tiny_moe_dir):
    """The whole loop with --fsdp.num_ranks 2 --fsdp.ep_size 2: the engine gets full HF-named expert
    weights from the sharded trainer, so its logprobs equal the trainer's at every step of a strictly
    on-policy run."""
    from instar.loop import run

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "What is {i}+1?", "label": "{i + 1}"}}\n' for i in range(8)))
    cfg = RLConfig()
    cfg.actor.model_name_or_path, cfg.actor.learning_rate = str(tiny_moe_dir), 1e-3
    cfg.data.prompt_dataset, cfg.data.max_new_tokens, cfg.data.max_len = str(prompts), 16, 128
    cfg.train.agent_path = str(Path(__file__).parent / "agents/length_env.py")
    cfg.train.max_steps, cfg.train.force_sync_mode = 2, True
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt = 2, 4
    cfg.fsdp.num_ranks, cfg.fsdp.ep_size = 2, 2
    cfg.ckpt.output_dir = str(tmp_path / "run")
    run(cfg)
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(abs(m["actor/vllm_kl"]) < 1e-3 for m in metrics)  # step 2 samples with the synced weights
    assert metrics[0]["actor/grad_norm"] > 0 and (tmp_path / "run/hf/model.safetensors").exists()

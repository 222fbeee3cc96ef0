"""Tensor parallelism over gloo equals one rank: tp=2 and tp=2 x dp=2 give the same logprobs, loss,
grad norm and weights as a single rank after 3 steps; a checkpoint saved in one layout resumes in
another (DCP reshards) to the same next step; impossible layouts are refused naming the fix."""

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from instar.checks import check_layout
from instar.config import ActorConfig, ConfigError, FSDPConfig, RLConfig, TrainConfig
from instar.contract import Sample
from instar.data.tiny_model import TinySpec, build_tiny_model
from instar.runtime.batching import rl_loss
from instar.train import checkpoint
from instar.train.batch import StepInputs
from instar.train.launch import free_port, run_ranks
from instar.train.worker import TrainWorker

LENGTHS = [7, 12, 5, 9, 3, 10, 4, 8]
RL = RLConfig()
RL.algo.advantage.is_correction_level, RL.algo.advantage.is_correction_mode = "token", "trunc"
TOL = {"rtol": 1e-4, "atol": 1e-5}  # float32 sums in another order (sharded matmuls, all-reduces)


def make_sample(n: int, seed: int) -> Sample:
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    return Sample(ids, mask, [-1.0 if m else 0.0 for m in mask], [0 if m else -1 for m in mask])


SAMPLES = [make_sample(n, i) for i, n in enumerate(LENGTHS)]
ADVANTAGES = [torch.full((n,), 1.0 if i % 2 else -1.0) for i, n in enumerate(LENGTHS)]


def _worker(model_dir, rank, world, port, tp) -> TrainWorker:
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir), learning_rate=1e-3, lr_warmup_steps=1),
                    FSDPConfig(num_ranks=world, tp_size=tp), TrainConfig(max_tokens_per_gpu=24, max_steps=10))
    w.init(rank, world, "127.0.0.1", port)
    return w


def _step(w: TrainWorker) -> dict[str, float]:
    return w.train_step(SAMPLES, partial(rl_loss, RL, 0.0), StepInputs(advantages=ADVANTAGES))


def _state(w: TrainWorker) -> dict[str, torch.Tensor]:
    return get_model_state_dict(w.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _train_job(rank, world, port, model_dir, tp, ckpt_dir):
    w = _worker(model_dir, rank, world, port, tp)
    out = {"initial": w.compute_logprobs(SAMPLES), "metrics": [_step(w), _step(w)]}
    if ckpt_dir:
        w.save(ckpt_dir, {"layout": (world, tp)})
    out["metrics"].append(_step(w))
    out |= {"state": _state(w), "logprobs": w.compute_logprobs(SAMPLES)}
    w.shutdown()
    return out


def _resume_job(rank, world, port, model_dir, tp, ckpt_dir):
    w = _worker(model_dir, rank, world, port, tp)
    extra = w.load(checkpoint.latest(ckpt_dir))
    out = {"extra": extra, "metrics": _step(w), "state": _state(w)}
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Dense tiny Qwen3 with 4 heads and 2 key/value heads: both divide by tp=2."""
    return build_tiny_model(tmp_path_factory.mktemp("tp_model"), TinySpec(heads=4, kv_heads=2))


@pytest.fixture(scope="module")
def one_rank(model_dir):
    return _train_job(0, 1, free_port(), model_dir, 1, None)


def assert_same(a: dict, b: dict) -> None:
    for got, want in zip(a["initial"] + a["logprobs"], b["initial"] + b["logprobs"]):
        torch.testing.assert_close(got, want, **TOL)
    for m, r in zip(a["metrics"], b["metrics"]):
        for k in ("actor/loss", "actor/grad_norm", "actor/policy_clip_ratio", "actor/entropy"):
            assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-6), k
    assert a["state"].keys() == b["state"].keys()
    for k in b["state"]:
        torch.testing.assert_close(a["state"][k], b["state"][k], **TOL, msg=k)


@pytest.mark.parametrize("world, tp", [(2, 2), (4, 2)], ids=["tp2", "tp2xdp2"])
def test_tensor_parallel_equals_one_rank(model_dir, one_rank, tmp_path, world, tp):
    ckpt = str(tmp_path / "ckpt")
    results = run_ranks(_train_job, world, model_dir, tp, ckpt, timeout=600)
    assert_same(results[0], one_rank)  # the full state dict is gathered on rank 0
    for r in results[1:]:  # every rank computes the same logprobs and metrics
        assert_same({**r, "state": results[0]["state"]}, one_rank)
    # The checkpoint of step 2 in this layout resumes at one rank and at another layout to the same step 3
    resumed = [_resume_job(0, 1, free_port(), model_dir, 1, ckpt),
               run_ranks(_resume_job, 2, model_dir, 2 if world == 4 else 1, ckpt, timeout=600)[0]]
    for r in resumed:
        assert r["extra"] == {"layout": (world, tp)}
        assert r["metrics"]["actor/loss"] == pytest.approx(one_rank["metrics"][2]["actor/loss"], rel=1e-4)
        for k in one_rank["state"]:
            torch.testing.assert_close(r["state"][k], one_rank["state"][k], **TOL, msg=k)


@pytest.mark.parametrize("fsdp, heads, fragment", [
    (FSDPConfig(num_ranks=3, tp_size=2), None, "must be a multiple of --fsdp.tp_size x --fsdp.cp_size = 2"),
    (FSDPConfig(num_ranks=2, tp_size=2), (4, 1), "must divide the model's attention heads (4) and key/value heads (1)"),
    (FSDPConfig(num_ranks=2, tp_size=0), None, "--fsdp.tp_size must be >= 1"),
])
def test_impossible_layouts_name_the_fix(fsdp, heads, fragment):
    model = None if heads is None else type("Config", (), {"num_attention_heads": heads[0],
                                                            "num_key_value_heads": heads[1]})()
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_layout(fsdp, model)


@pytest.mark.slow
def test_rl_runs_two_steps_with_tensor_parallel_ranks(tmp_path, model_dir):
    """The whole loop with --fsdp.num_ranks 2 --fsdp.tp_size 2: the engine gets full weights from the
    sharded trainer, so its logprobs equal the trainer's at every step of a strictly on-policy run."""
    from instar.loop import run

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "What is {i}+1?", "label": "{i + 1}"}}\n' for i in range(8)))
    cfg = RLConfig()
    cfg.actor.model_name_or_path, cfg.actor.learning_rate = str(model_dir), 1e-3
    cfg.data.prompt_dataset, cfg.data.max_new_tokens, cfg.data.max_len = str(prompts), 16, 128
    cfg.train.agent_path = str(Path(__file__).parent / "agents/length_env.py")
    cfg.train.max_steps, cfg.train.force_sync_mode = 2, True
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt = 2, 4
    cfg.fsdp.num_ranks, cfg.fsdp.tp_size = 2, 2
    cfg.ckpt.output_dir = str(tmp_path / "run")
    run(cfg)
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(abs(m["actor/vllm_kl"]) < 1e-3 for m in metrics)  # step 2 samples with the synced weights
    assert metrics[0]["actor/grad_norm"] > 0 and (tmp_path / "run/hf/model.safetensors").exists()

"""What the layout-equivalence tests share (tests/test_parallel.py, test_expert_parallel.py,
test_context_parallel.py, test_shared_prefix.py and others): made-up samples (prefix-tree groups too), trainer-rank
jobs in a given layout (three steps with a checkpoint, a resume), the comparison with one rank, and a two-step
`instar rl` run in a layout."""

import json
import random
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from instar.config import ActorConfig, FSDPConfig, RLConfig, TrainConfig
from instar.contract import Sample
from instar.runtime.batching import rl_loss
from instar.train import checkpoint
from instar.train.batch import StepInputs
from instar.train.launch import reserve_port, run_ranks
from instar.train.worker import TrainWorker

TOL = {"rtol": 1e-4, "atol": 1e-5}  # float32 sums in another order (sharded matmuls, all-reduces, all-to-alls)


def rl_config() -> RLConfig:
    """PPO without KL, token-level truncated IS (the samples' rollout logprobs are made up)."""
    cfg = RLConfig()
    cfg.algo.advantage.is_correction_level, cfg.algo.advantage.is_correction_mode = "token", "trunc"
    return cfg


def make_sample(n: int, seed: int, routes: torch.Tensor | None = None) -> Sample:
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    return Sample(ids, mask, [-1.0 if m else 0.0 for m in mask], [0 if m else -1 for m in mask], routes)


def grouped(seed: int, prompts: int, per_prompt: int, long_tail: bool = False) -> list[list[int]]:
    """Token sequences in groups that share a prompt (9-16 tokens), for prefix-tree rows; plus a duplicate and a
    sequence that is another's start."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(prompts):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(9, 16))]
        seqs += [prompt + [rng.randrange(3, 500) for _ in range(rng.randint(*(1, 40) if long_tail else (12, 20)))]
                 for _ in range(per_prompt)]
    return seqs + [list(seqs[0]), seqs[1][:5]]


class EvalModule(torch.nn.Module):
    """The attention functions' ``module`` argument, in eval mode (no dropout)."""

    training = False


def advantages(lengths: list[int]) -> list[torch.Tensor]:
    return [torch.full((n,), 1.0 if i % 2 else -1.0) for i, n in enumerate(lengths)]


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: gathered from its shards, or itself on a lone (unsharded) rank."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state(w) -> dict[str, torch.Tensor]:
    """The policy's full state dict, gathered on rank 0 (empty on the others)."""
    return get_model_state_dict(w.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def assert_same(a: dict, b: dict, metrics: tuple[str, ...] = ("actor/loss", "actor/grad_norm",
                                                               "actor/policy_clip_ratio", "actor/entropy")) -> None:
    """``a`` (a sharded run) equals ``b`` (one rank): logprobs before and after, each step's metrics, weights."""
    for got, want in zip(a["initial"] + a["logprobs"], b["initial"] + b["logprobs"], strict=True):
        torch.testing.assert_close(got, want, **TOL)
    for m, r in zip(a["metrics"], b["metrics"], strict=True):
        for k in metrics:
            assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-6), k
    assert a["state"].keys() == b["state"].keys()
    for k in b["state"]:
        torch.testing.assert_close(a["state"][k], b["state"][k], **TOL, msg=k)


def make_worker(model_dir, rank: int, world: int, port: int, fsdp: dict, replay: bool = False) -> TrainWorker:
    """A trainer rank in the layout ``fsdp`` (FSDPConfig fields); ``replay``: routing replay, frozen routers."""
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir), learning_rate=1e-3, lr_warmup_steps=1,
                                freeze_moe_router=replay),
                    FSDPConfig(num_ranks=world, **fsdp), TrainConfig(max_tokens_per_gpu=24, max_steps=10,
                                                                     routing_replay=replay))
    w.init(rank, world, "127.0.0.1", port)
    return w


def step(w: TrainWorker, samples: list[Sample]) -> dict[str, float]:
    """One PPO update on ``samples`` (advantage -1 / +1 by position)."""
    inputs = StepInputs(advantages=advantages([len(s.token_ids) for s in samples]))
    return w.train_policy(samples, partial(rl_loss, rl_config(), 0.0), inputs).metrics


def train_job(rank, world, port, model_dir, fsdp: dict, samples: list[Sample], ckpt_dir: str | None) -> dict:
    """Three steps (a checkpoint after the second when ``ckpt_dir``), with logprobs before and after."""
    w = make_worker(model_dir, rank, world, port, fsdp)
    out = {"initial": w.compute_logprobs(samples), "metrics": [step(w, samples), step(w, samples)]}
    if ckpt_dir:
        w.save(ckpt_dir, {"layout": (world, fsdp)})
    out["metrics"].append(step(w, samples))
    out |= {"state": full_state(w), "logprobs": w.compute_logprobs(samples)}
    w.shutdown()
    return out


def resume_job(rank, world, port, model_dir, fsdp: dict, samples: list[Sample], ckpt_dir: str) -> dict:
    w = make_worker(model_dir, rank, world, port, fsdp)
    out = {"extra": w.load(checkpoint.latest(ckpt_dir)), "metrics": step(w, samples), "state": full_state(w)}
    w.shutdown()
    return out


def check_equals_one_rank(model_dir, samples: list[Sample], one_rank: dict, world: int, fsdp: dict,
                          other: dict, ckpt_dir: str) -> None:
    """``world`` ranks in layout ``fsdp`` train like one rank, every rank computing the same; the checkpoint
    of their step 2 resumes at one rank and in the 2-rank layout ``other`` to one rank's step 3."""
    results = run_ranks(train_job, world, model_dir, fsdp, samples, ckpt_dir, timeout=600)
    assert_same(results[0], one_rank)  # the full state dict is gathered on rank 0
    for r in results[1:]:
        assert_same({**r, "state": results[0]["state"]}, one_rank)
    resumed = [resume_job(0, 1, reserve_port(), model_dir, {}, samples, ckpt_dir),
               run_ranks(resume_job, 2, model_dir, other, samples, ckpt_dir, timeout=600)[0]]
    for r in resumed:
        assert r["extra"] == {"layout": (world, fsdp)}
        assert r["metrics"]["actor/loss"] == pytest.approx(one_rank["metrics"][2]["actor/loss"], rel=1e-4)
        for k in one_rank["state"]:
            torch.testing.assert_close(r["state"][k], one_rank["state"][k], **TOL, msg=k)


def rl_two_steps(tmp_path: Path, model_dir, **fsdp) -> list[dict]:
    """`instar rl` for 2 strictly on-policy steps with the given ``--fsdp.*`` settings; its metrics rows."""
    from instar.loop import run

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "What is {i}+1?", "label": "{i + 1}"}}\n' for i in range(8)))
    cfg = RLConfig()
    cfg.actor.model_name_or_path, cfg.actor.learning_rate = str(model_dir), 1e-3
    cfg.data.prompt_dataset, cfg.data.max_new_tokens, cfg.data.max_len = str(prompts), 16, 128
    cfg.train.agent_path = str(Path(__file__).resolve().parents[1] / "agents/length_env.py")
    cfg.train.max_steps, cfg.train.force_sync_mode = 2, True
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt = 2, 4
    for key, value in fsdp.items():
        setattr(cfg.fsdp, key, value)
    cfg.ckpt.output_dir = str(tmp_path / "run")
    run(cfg)
    return [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]

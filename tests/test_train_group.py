"""The trainer ranks as a 2-rank Ray actor group: calls fan out, samples come back in input order."""

import asyncio
import os
from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM

from instar.config import ActorConfig, FSDPConfig, RLConfig, TrainConfig
from instar.contract import Sample
from instar.runtime.batching import rl_loss
from instar.runtime.trainer_group import TrainerGroup
from instar.train import checkpoint
from instar.train.batch import StepInputs


def _sample(n: int, seed: int) -> Sample:
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Sample(ids, [0] * 2 + [1] * (n - 2), [0.0] * 2 + [-1.0] * (n - 2), [-1] * 2 + [0] * (n - 2))


@pytest.mark.slow
def test_two_rank_ray_group(ray_cluster, tiny_model_dir, tmp_path):
    cfg = RLConfig(actor=ActorConfig(model_name_or_path=str(tiny_model_dir), learning_rate=1e-3),
                   fsdp=FSDPConfig(num_ranks=2), train=TrainConfig(max_tokens_per_gpu=16))
    samples = [_sample(n, i) for i, n in enumerate([9, 4, 12, 6, 5])]

    async def run():
        group = await TrainerGroup.start(cfg)
        try:
            logprobs = await group.compute_logprobs(samples)
            inputs = StepInputs(advantages=[torch.full((len(s.token_ids),), 1.0) for s in samples],
                                old_logprobs=logprobs)
            metrics = (await group.train_policy(samples, partial(rl_loss, cfg, 0.0), inputs)).metrics
            path = await group.save(str(tmp_path), {"data_position": 5}, 2)
            extra = await group.load(path)
        finally:
            await group.shutdown()
        return logprobs, metrics, path, extra

    logprobs, metrics, path, extra = asyncio.run(run())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for s, lp in zip(samples, logprobs):
        ids = torch.tensor([s.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(lp[1:], ref, atol=1e-5, rtol=0)
    assert metrics["actor/samples"] == 5 and metrics["actor/action_tokens"] == 26
    assert extra == {"data_position": 5} and checkpoint.latest(str(tmp_path)) == path
    assert sorted(p.name for p in (tmp_path / "step_1").iterdir() if p.name.startswith("rng")) == [
        "rng_rank0.pt", "rng_rank1.pt"]


def test_a_rank_beside_the_engines_computes_with_every_core_while_nothing_generates(tiny_model_dir):
    """The rank reads the driver's GenerationFlag before each micro-batch and after each layer: its share of
    the cores while rollouts generate (engines and trainer compute at once), the node's cores split among
    the trainer ranks only while they do not; in backward too, when it reaches each layer."""
    from instar.runtime.trainer_group import _Rank
    from instar.train.launch import GenerationFlag, cpu_threads, reserve_port

    flag = GenerationFlag()
    rank = _Rank(ActorConfig(model_name_or_path=str(tiny_model_dir)), FSDPConfig(num_ranks=1),
                 TrainConfig(max_tokens_per_gpu=16), cpu_share=2, idle_share=1, generation=flag.path)
    flag.unlink()  # as the driver does once the ranks are up: the rank reads it all the same
    assert not os.path.exists(flag.path)
    try:
        rank.init(0, 1, "127.0.0.1", reserve_port())
        samples = [_sample(n, i) for i, n in enumerate([9, 4, 12, 6, 5])]  # 3 micro-batches of <= 16 tokens
        flag.set(True)
        rank.compute_logprobs(samples)
        busy = list(rank.threads_used)
        rank.threads_used.clear()
        flag.set(False)
        rank.compute_logprobs(samples)
        idle = list(rank.threads_used)
        rank.train_policy(samples[:2], partial(rl_loss, RLConfig(), 0.0),
                        StepInputs(advantages=[torch.ones(len(s.token_ids)) for s in samples[:2]]))
        trained = list(rank.threads_used)
    finally:
        rank.shutdown()
        flag.close()
        torch.set_num_threads(1)
    # each micro-batch's start and each of its layers (no backward, so no gradient hooks: 3 x (1 + 2));
    # one training micro-batch: its start, 2 layers forward, 2 backward
    assert busy == [cpu_threads(2)] * 9 and idle == [cpu_threads(1)] * 9 and trained == [cpu_threads(1)] * 5

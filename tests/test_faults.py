"""Actors killed mid-run, on the real topology (tiny model, CPU): a restarted agent runner's groups run
again and a restarted engine gets the policy's weights before it serves, so the run finishes; a dead
trainer rank stops the run at once, naming the rank and the checkpoint to resume from."""

import os
import signal
import time

import pytest
import ray
from helpers.loop import ROOT, kill_when, logged, make_cfg, rows

from instar.contract import read_jsonl
from instar.loop import run
from instar.runtime.trainer_group import TrainerGroup

pytestmark = pytest.mark.slow


def test_a_killed_agent_runner_is_restarted_and_its_groups_run_again(tmp_path, tiny_model_dir, prompts, clusters):
    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{
        "train.force_sync_mode": True, "train.agent_path": str(ROOT / "tests/agents/slow_env.py")})
    killed = kill_when(logged(tmp_path / "run/metrics.jsonl", 1), lambda: clusters[0].agents[0])
    run(cfg)  # sync mode: both groups of step 2 are in flight (scoring takes 1.5 s) once step 1 is logged
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert killed and [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["trajectories"] == 8 for m in metrics)  # the groups ran again whole
    assert [(m["faults/agent_restarts"], m["faults/requeued_groups"]) for m in metrics] == [(0, 0), (1, 2), (1, 2)]


# The other engine serves meanwhile. A lone engine killed (its batch all dropped, the weights sent at once):
# tests/test_placement.py, on two Ray nodes.
def test_a_killed_engine_serves_again_only_with_the_policys_weights(tmp_path, tiny_model_dir, prompts, clusters):
    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{
        "train.force_sync_mode": True, "engine.num_engines": 2, "train.rollout_dump_dir": str(tmp_path / "dump"),
        "train.agent_path": str(ROOT / "tests/agents/slow_env.py")})  # step 2's sync comes >= 1.5 s after the kill
    killed = kill_when(logged(tmp_path / "run/metrics.jsonl", 1), lambda: clusters[0].engines[-1])
    run(cfg)
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert killed and [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["faults/engine_restarts"] for m in metrics] == [0, 1, 1]  # found and rejoined at step 2's sync
    # Step 3 was sampled after that sync: nothing dropped, every token from policy version 2, on-policy
    third = read_jsonl(str(tmp_path / "dump/step_000003.jsonl"))
    versions = {v for t in third for s in t.segments for v, m in zip(s.versions, s.action_mask) if m}
    assert len(third) == 8 and versions == {2}
    assert abs(metrics[2]["actor/vllm_kl"]) < 1e-3, metrics  # every figure of the run, to tell which side was off


def test_an_engine_killed_in_a_weight_sync_is_restarted_and_the_sync_done_again(tmp_path, tiny_model_dir, prompts,
                                                                                clusters, monkeypatch):
    """An engine dies in step 1's weight sync (killed once the sync is announced, as the trainer starts sending): the
    trainer and the other engine leave the broken broadcast within seconds, not at the group's 600 s timeout; Ray
    restarts the engine, all join a new group and the sync is done again. Step 2 samples the policy of step 1."""
    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{
        "train.force_sync_mode": True, "engine.num_engines": 2, "train.rollout_dump_dir": str(tmp_path / "dump")})
    send, killed = TrainerGroup.send_weights, []

    def killing_first(self, *args, **kwargs):
        if not killed:  # SIGKILL: the engine runs no more of the sync (Ray's kill may land after a short sync ends)
            os.kill(ray.get(clusters[0].engines[-1].__ray_call__.remote(lambda _: os.getpid())), signal.SIGKILL)
            killed.append(time.monotonic())
        return send(self, *args, **kwargs)

    monkeypatch.setattr(TrainerGroup, "send_weights", killing_first)
    run(cfg)
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert killed and [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["faults/engine_restarts"] for m in metrics] == [1, 1, 1]
    print(f"step 1's weight sync, an engine killed in it: {metrics[0]['weight_sync/total_s']:.1f} s")
    assert metrics[0]["weight_sync/total_s"] < 60
    second = read_jsonl(str(tmp_path / "dump/step_000002.jsonl"))
    versions = {v for t in second for s in t.segments for v, m in zip(s.versions, s.action_mask) if m}
    assert len(second) == 8 and versions == {1}
    assert abs(metrics[1]["actor/vllm_kl"]) < 1e-3, metrics


def test_a_killed_trainer_rank_stops_the_run_within_a_minute(tmp_path, tiny_model_dir, prompts, clusters):
    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{
        "train.force_sync_mode": True, "fsdp.num_ranks": 2, "ckpt.save_steps": 1, "train.max_steps": 5})
    checkpoint = tmp_path / "run/checkpoints/step_1"
    killed = kill_when(checkpoint.exists, lambda: clusters[0].trainer.ranks[1], restart=False)
    with pytest.raises(RuntimeError, match="trainer rank 1 died") as error:
        run(cfg)
    stopped_after = time.monotonic() - killed[0]
    print(f"run stopped {stopped_after:.1f} s after trainer rank 1 was killed")
    assert stopped_after < 60
    assert f"the latest checkpoint is {checkpoint}: resume from it with --ckpt.load_enable true" in str(error.value)

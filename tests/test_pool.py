"""The streaming rollout pool: a resumed pool hands out the checkpoint's groups first and never reuses
a group id; sync mode starts generating only when told the weights were updated; a group whose agent
runner died is launched again, unless Ray gave up on the runner."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from instar.config import RLConfig
from instar.contract import Sample, SamplingParams, Trajectory
from instar.data.prompts import Prompt, PromptStream
from instar.runtime import pool as pool_module
from instar.runtime.pool import Group, PoolState, RolloutPool


class FakeAgent:
    """An agent-runner actor handle: ``run_group.remote(tasks)`` answers one trajectory per task, or
    raises the next of ``deaths`` (the actor died while running the group)."""

    def __init__(self, deaths=()):
        self.launched: list[int] = []
        self.prompts: list[int] = []
        self.run_group = self
        self.deaths = list(deaths)

    async def remote(self, tasks):
        self.launched.append(tasks[0].group_id)
        self.prompts.append(tasks[0].prompt_index)
        await asyncio.sleep(0)
        if self.deaths:
            raise self.deaths.pop(0)
        return [Trajectory([Sample([1, 2], [0, 1], [0.0, -0.1], [-1, 0])], reward=1.0, group_id=t.group_id)
                for t in tasks]


def pool(state=None, sync=False, deaths=(), generating=None):
    cfg = RLConfig()
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.train.force_sync_mode = 2, 2, sync
    stream = PromptStream([Prompt(i, [{"role": "user", "content": str(i)}]) for i in range(8)])
    agent = FakeAgent(deaths)
    return RolloutPool([agent], stream, cfg, SamplingParams(), state, generating), agent


def test_a_resumed_pool_hands_out_the_saved_groups_first_and_continues_the_ids():
    saved = PoolState([Group(41, 0, 3, [])], next_group_id=42)

    async def main():
        p, agent = pool(saved)
        first = await p.next_batch(2)
        await p.close()
        return first, agent.launched

    first, launched = asyncio.run(main())
    assert [g.group_id for g in first] == [41, 42]
    assert launched[0] == 42 and 41 not in launched


def test_sync_mode_generates_again_only_after_the_weights_are_updated():
    async def main():
        p, agent = pool(sync=True)
        await p.next_batch(2)
        await asyncio.sleep(0.01)
        before = list(agent.launched)
        p.weights_updated()
        await asyncio.sleep(0.01)
        after = list(agent.launched)
        await p.close()
        return before, after

    before, after = asyncio.run(main())
    assert before == [0, 1] and after == [0, 1, 2, 3]


def test_async_mode_runs_one_batch_ahead_of_the_batch_in_training():
    """async_queue_size 1: while batch k trains, batch k+1 is generated; k+2 waits for the weights that
    follow step k (sampled earlier it would be two versions stale, or restarted by the weight sync)."""
    async def main():
        p, agent = pool()
        await p.next_batch(2)  # batch 0 (groups 0, 1) goes to training (step 1)
        await asyncio.sleep(0.01)  # batch 1 (groups 2, 3) runs and finishes meanwhile
        during = list(agent.launched)
        p.weights_updated()  # step 1's weights reached the engines
        await asyncio.sleep(0.01)
        after_sync = list(agent.launched)
        second = await p.next_batch(2)
        await asyncio.sleep(0.01)
        await p.close()
        return during, after_sync, [g.group_id for g in second], list(agent.launched)

    during, after_sync, second, launched = asyncio.run(main())
    assert during == [0, 1, 2, 3]  # not 4, 5: batch 2 would start under the weights before step 1's
    assert after_sync == [0, 1, 2, 3, 4, 5] and second == [2, 3]
    assert launched == [0, 1, 2, 3, 4, 5]  # batch 3 waits while batch 1 trains


def test_each_weight_sync_releases_the_batch_it_was_trained_on():
    """The sync after step k may still run while batch k+1 is handed out: each weights_updated releases one
    batch, the oldest, so batch k+3 does not start under the weights that follow step k."""
    async def main():
        p, agent = pool()
        await p.next_batch(2)  # batch 0 trains (step 1)
        await asyncio.sleep(0.01)
        p.weights_updated()  # step 1's weights are there: batch 2 starts
        await p.next_batch(2)  # batch 1 trains (step 2)
        await asyncio.sleep(0.01)
        await p.next_batch(2)  # batch 2 is handed out while step 2's weights are on their way
        await asyncio.sleep(0.01)
        before = list(agent.launched)
        p.weights_updated()  # step 2's weights: batch 3 may start, not batch 4
        await asyncio.sleep(0.01)
        after = list(agent.launched)
        await p.close()
        return before, after

    before, after = asyncio.run(main())
    assert before == [0, 1, 2, 3, 4, 5] and after == [0, 1, 2, 3, 4, 5, 6, 7]


def test_the_pool_says_when_generation_runs():
    """Generating: groups in flight, or a batch handed out before the last one's weights arrived (their
    arrival launches more). The trainer computes with every core only in between."""
    told: list[bool] = []

    async def main():
        p, _ = pool(generating=told.append)
        await p.next_batch(2)  # batch 0 trains; batch 1 runs and finishes meanwhile
        await asyncio.sleep(0.01)
        seen = [list(told)]
        p.weights_updated()  # batch 2 starts, and finishes
        await asyncio.sleep(0.01)
        await p.next_batch(2)  # batch 1 trains
        await asyncio.sleep(0.01)
        await p.next_batch(2)  # batch 2 handed out while step 2's weights travel: more will start
        seen.append(list(told))
        p.weights_updated()  # batch 3 starts
        await asyncio.sleep(0.01)
        await p.close()
        return seen

    seen = asyncio.run(main())
    assert seen[0] == [True, False]
    assert seen[1] == [True, False, True, False, True]
    assert told == [True, False, True, False, True, False]


def test_a_slow_group_is_trained_before_later_ones_that_finished_first():
    """Launch order, not finishing order: taken a step later, a slow group would be a version staler than
    --train.async_queue_size allows."""
    class SlowFirst(FakeAgent):
        async def remote(self, tasks):
            if tasks[0].group_id == 1:
                await asyncio.sleep(0.05)
            return await super().remote(tasks)

    async def main():
        p, _ = pool()
        p.agents = [SlowFirst()]
        first = await p.next_batch(2)
        await p.close()
        return [g.group_id for g in first]

    assert asyncio.run(main()) == [0, 1]  # groups 2 and 3 finished before group 1


def restarting():
    return ActorUnavailableError("The actor is temporarily unavailable: The actor was restarted", None)


def test_groups_of_a_restarted_agent_runner_run_again_and_are_counted(monkeypatch):
    monkeypatch.setattr(pool_module, "RELAUNCH_DELAY_S", 0.0)

    async def main():
        # both groups in flight die; group 0's first relaunch fails too (the runner is still restarting)
        p, agent = pool(sync=True, deaths=[restarting(), restarting(), restarting()])
        batch = await p.next_batch(2)
        await p.close()
        return batch, agent, p.metrics()

    batch, agent, metrics = asyncio.run(main())
    assert agent.launched == [0, 1, 0, 1, 0] and agent.prompts[:2] == agent.prompts[2:4]  # same groups, prompts
    assert [(g.group_id, g.prompt_index, len(g.trajectories)) for g in batch] == [
        (0, agent.prompts[0], 2), (1, agent.prompts[1], 2)]  # in launch order (group 1 finished first)
    assert metrics == {"faults/agent_restarts": 1.0, "faults/requeued_groups": 2.0}


def test_an_agent_runner_ray_no_longer_restarts_stops_the_run():
    async def main():
        p, _ = pool(sync=True, deaths=[ActorDiedError()])
        try:
            await p.next_batch(2)
        finally:
            await p.close()

    with pytest.raises(RuntimeError, match="agent runner 0 is dead and Ray no longer restarts it"):
        asyncio.run(main())

"""The streaming rollout pool: a resumed pool hands out the checkpoint's groups first and never reuses
a group id; sync mode starts generating only when told the weights were updated."""

import asyncio

from instar.config import RLConfig
from instar.contract import Sample, SamplingParams, Trajectory
from instar.data.prompts import Prompt, PromptStream
from instar.runtime.pool import Group, PoolState, RolloutPool


class FakeAgent:
    """An agent-runner actor handle: ``run_group.remote(tasks)`` answers one trajectory per task."""

    def __init__(self):
        self.launched: list[int] = []
        self.run_group = self

    async def remote(self, tasks):
        self.launched.append(tasks[0].group_id)
        await asyncio.sleep(0)
        return [Trajectory([Sample([1, 2], [0, 1], [0.0, -0.1], [-1, 0])], reward=1.0, group_id=t.group_id)
                for t in tasks]


def pool(state=None, sync=False):
    cfg = RLConfig()
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.train.force_sync_mode = 2, 2, sync
    stream = PromptStream([Prompt(i, [{"role": "user", "content": str(i)}]) for i in range(8)])
    agent = FakeAgent()
    return RolloutPool([agent], stream, cfg, SamplingParams(), state), agent


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

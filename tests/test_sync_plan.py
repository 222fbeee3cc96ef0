"""`SyncPlan`, the one place that decides when the loop waits for a weight sync and how the engines take it,
and the loop's `WeightSync` carrying it out."""

import asyncio

import pytest

from instar.config import TrainConfig
from instar.loop import WeightSync
from instar.runtime.cluster import SyncPlan


# force_sync_mode with partial_rollout_enable is rejected before a plan is made (tests/test_config.py)
@pytest.mark.parametrize(("force_sync_mode", "async_queue_size", "partial_rollout_enable", "wait", "in_flight"), [
    (False, 1, False, False, "drain"),  # the default: the sync overlaps the next step
    (False, 1, True, False, "keep"),
    (False, 0, False, True, "drain"),  # nothing is generated ahead, so nothing can overlap the sync
    (False, 0, True, True, "keep"),
    (True, 1, False, True, "drain"),  # strictly on-policy, whatever the queue size
    (True, 0, False, True, "drain"),
])
def test_the_plan_of_each_mode(force_sync_mode, async_queue_size, partial_rollout_enable, wait, in_flight):
    train = TrainConfig(force_sync_mode=force_sync_mode, async_queue_size=async_queue_size,
                        partial_rollout_enable=partial_rollout_enable)
    assert SyncPlan.from_config(train) == SyncPlan(wait=wait, in_flight=in_flight, background=True,
                                                   resume_in_flight="drain", restore_in_flight="keep")


class FakeCluster:
    """`Cluster.start_sync` whose syncs end when ``arrive`` is set; their figure is the version sent."""

    def __init__(self, plan: SyncPlan):
        self.plan, self.calls, self.arrive = plan, [], asyncio.Event()

    async def start_sync(self, version, in_flight, background):
        self.calls.append((version, in_flight, background))

        async def arrived():
            await self.arrive.wait()
            return {"weight_sync/bytes": float(version)}
        return arrived()


class FakePool:
    updated = 0

    def weights_updated(self):
        self.updated += 1


def figures(metrics: dict) -> dict:
    """A finished sync's figures without its wall time (which every finished sync reports); none: no sync."""
    if metrics:
        assert isinstance(metrics.pop("weight_sync/total_s"), float)
    return metrics


@pytest.mark.parametrize("wait", [False, True])
def test_the_loop_waits_for_a_sync_only_where_the_plan_says(wait):
    async def go():
        cluster, pool = FakeCluster(SyncPlan(wait=wait, in_flight="keep")), FakePool()
        sync = WeightSync(cluster, pool)
        sending = asyncio.ensure_future(sync.send(1))
        await asyncio.sleep(0.05)
        assert sending.done() is not wait  # the weights have not arrived yet
        assert pool.updated == 1  # the pool launches the next groups once the sync is on its way
        cluster.arrive.set()
        first = figures(await sending)
        second = figures(await sync.send(2))
        return first, second, figures(await sync.finish()), cluster.calls

    first, second, last, calls = asyncio.run(go())
    if wait:  # each sync's figures join the row of its own step
        assert (first, second, last) == ({"weight_sync/bytes": 1.0}, {"weight_sync/bytes": 2.0}, {})
    else:  # ... or of the step it ends in: the next sync awaits the last one first
        assert (first, second, last) == ({}, {"weight_sync/bytes": 1.0}, {"weight_sync/bytes": 2.0})
    assert calls == [(1, "keep", True), (2, "keep", True)]

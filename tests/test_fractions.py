"""The per-step use fractions (`instar.runtime.metrics.Usage` and the counters it reads) stay in [0, 1]: each
actor reads its counters and its clock at one instant, an engine between two of its steps, and the first
interval leaves out what the actors did before the loop began."""

import asyncio
import threading
import time

import ray
from helpers.engine import PROMPTS, run_engine

from instar.config import EngineConfig
from instar.contract import SamplingParams
from instar.runtime.metrics import Usage


class Scripted:
    """The shape of a Ray actor handle whose `stats.remote()` answers from a script, one answer per call."""

    def __init__(self, *answers):
        self.answers, self.stats = iter(answers), self

    def remote(self):
        answer = next(self.answers)

        async def call():
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return call()


def read(agents, engines, reads=1):
    async def main():
        usage = Usage(agents, engines)  # asks every actor once, as the loop starts
        return [await usage.read() for _ in range(reads)]
    return asyncio.run(main())


def engine(prompt, hits, sampled, busy, steps, sleeps, seconds):
    return {"prompt_tokens": prompt, "prefix_hit_tokens": hits, "sampled_tokens": sampled, "busy_seconds": busy,
            "steps": steps, "sleeps": sleeps, "seconds": seconds}


def test_fractions_are_changes_of_each_actors_own_counters_and_clock():
    """7 CPU seconds of start-up before the loop are not counted; each engine's busy time is over its own clock."""
    agents = [Scripted({"agent/finished": 0.0, "cpu_seconds": 7.0, "core_seconds": 2000.0},
                       {"agent/finished": 4.0, "cpu_seconds": 7.5, "core_seconds": 2004.0}),
              Scripted({"agent/finished": 1.0, "cpu_seconds": 3.0, "core_seconds": 1000.0},
                       {"agent/finished": 2.0, "agent/dropped_invalid": 1.0, "cpu_seconds": 4.0,
                        "core_seconds": 1004.0})]
    engines = [Scripted(engine(100, 10, 50, 3.0, 10, 0, 200.0), engine(140, 40, 90, 3.5, 20, 1, 202.0)),
               Scripted(engine(0, 0, 0, 1.0, 0, 0, 50.0), engine(60, 0, 20, 2.5, 10, 1, 52.0))]
    assert read(agents, engines) == [{
        "agent/finished": 6.0, "agent/dropped_invalid": 1.0, "agent/cpu_fraction": 1.5 / 8,
        "engine/idle_fraction": 1 - 2.0 / 4, "engine/rows_per_step": 60 / 20, "engine/step_ms": 1000 * 2.0 / 20,
        "engine/sleeps": 1.0, "engine/prefix_hit_rate": 30 / 100}]


def test_a_restarted_or_restarting_actor_is_left_out_of_that_rows_fractions():
    """An agent runner restarted by Ray (its CPU time began again), an engine Ray is restarting (its call fails),
    and one restarted (its counters are lower, its clock is not): none counts in that row; the next row counts
    them again from their new answers."""
    agents = [Scripted({"cpu_seconds": 1.0, "core_seconds": 10.0}, {"cpu_seconds": 2.0, "core_seconds": 14.0},
                       {"agent/finished": 1.0, "cpu_seconds": 0.5, "core_seconds": 18.0},
                       {"agent/finished": 1.0, "cpu_seconds": 1.5, "core_seconds": 22.0})]
    engines = [Scripted(engine(10, 5, 8, 1.0, 4, 0, 100.0), engine(20, 5, 16, 2.0, 8, 0, 102.0),
                        ray.exceptions.RayActorError(), engine(30, 10, 24, 3.0, 12, 0, 106.0)),
               Scripted(engine(10, 0, 8, 1.0, 4, 0, 300.0), engine(20, 10, 16, 1.5, 8, 0, 302.0),
                        engine(4, 4, 2, 0.25, 1, 0, 304.0), engine(8, 6, 4, 0.75, 2, 0, 306.0))]
    first, second, third = read(agents, engines, reads=3)
    assert first["agent/cpu_fraction"] == 1 / 4 and first["engine/idle_fraction"] == 1 - 1.5 / 4
    assert second == {"agent/finished": 1.0}  # every actor restarted or restarting: no fraction at all
    assert third["agent/cpu_fraction"] == 1 / 4
    # the first engine has no answer from the read before to measure from; the second measures from its restart
    assert third["engine/idle_fraction"] == 1 - 0.5 / 2 and third["engine/prefix_hit_rate"] == 2 / 4


def test_engine_counters_read_mid_step_from_another_thread_are_consistent(dense):
    """A reader on another thread (as `EngineActor.stats`) while steps run: between any two of its reads, busy
    seconds never exceed the engine's clock, and prefix hits never exceed the prompt tokens admitted (a group's
    twins are admitted before the forward and hit after it, within one step)."""
    snapshots, done = [], threading.Event()

    def reader(engine):
        while not done.is_set():
            snapshots.append(dict(engine.stats))
            time.sleep(0.001)

    async def body(engine):
        step = engine._run

        def slow_run(group):  # a long forward: most reads fall inside a step
            time.sleep(0.01)
            step(group)
        engine._run = slow_run
        thread = threading.Thread(target=reader, args=(engine,))
        thread.start()
        params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s) for s in range(4)]
        for prompt in PROMPTS:  # each a group of four: one computes the prompt, three copy it
            await asyncio.gather(*(engine.generate(prompt, p) for p in params))
            await asyncio.sleep(0.02)  # idle time between the groups
        done.set()
        thread.join()

    run_engine(dense, body, EngineConfig(enable_prefix_caching=True))
    assert len(snapshots) > 20
    changes = [{k: after[k] - before[k] for k in after} for before, after in zip(snapshots, snapshots[1:])]
    assert all(0 <= c["prefix_hit_tokens"] <= c["prompt_tokens"] for c in changes)
    assert all(0 <= c["busy_seconds"] <= c["seconds"] for c in changes)
    assert snapshots[-1]["prefix_hit_tokens"] == 3 * sum(len(p) - 1 for p in PROMPTS)

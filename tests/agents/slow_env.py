"""The length Env, but it takes a second and a half to score: its groups are surely in flight when a
test kills their runner (or an engine) right after a step is logged, and the next weight sync surely comes
after the kill (the fast one can finish a group, or a whole step, first)."""

import asyncio

from instar.agents import Env, Result, StepEnvRunner


class SlowLengthEnv(Env):
    async def step(self, state: dict) -> Result:
        await asyncio.sleep(1.5)
        reward = float(len(state["action_text"]) % 3) / 2
        return Result(reward=reward, score=reward)


AgentRunner = StepEnvRunner(SlowLengthEnv)

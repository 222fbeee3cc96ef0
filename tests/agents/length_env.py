"""A test Env whose reward depends on what was sampled (its length), so groups have non-zero
advantages even under a random-init model."""

from instar.agents import Env, Result, StepEnvRunner


class LengthEnv(Env):
    async def step(self, state: dict) -> Result:
        reward = float(len(state["action_text"]) % 3) / 2
        return Result(reward=reward, score=reward)


AgentRunner = StepEnvRunner(LengthEnv)

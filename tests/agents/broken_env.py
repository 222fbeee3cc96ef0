"""A test Env whose every step raises: every rollout is dropped, so no batch has anything to train on."""

from instar.agents import Env, Result, StepEnvRunner


class BrokenEnv(Env):
    async def step(self, state: dict) -> Result:
        raise ValueError("this env always fails")


AgentRunner = StepEnvRunner(BrokenEnv)

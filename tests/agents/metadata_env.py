"""A test Env that scores a rollout by a column of its prompt record that no flag names: the record's
``difficulty`` reaches it in ``state["metadata"]``."""

from instar.agents import Env, Result, StepEnvRunner


class MetadataEnv(Env):
    async def step(self, state: dict) -> Result:
        return Result(reward=float(state["metadata"]["difficulty"]))


AgentRunner = StepEnvRunner(MetadataEnv)

"""A test Env whose score is known in advance: 1 when the prompt's label is "yes", whatever the
model says. An eval over it must therefore report exactly the fraction of "yes" labels."""

from instar.agents import Env, Result, StepEnvRunner


class LabelEnv(Env):
    async def step(self, state: dict) -> Result:
        score = float(state["label"] == "yes")
        return Result(reward=score, score=score)


AgentRunner = StepEnvRunner(LabelEnv)

"""A test Env whose reward depends on what was sampled (its length), so groups have non-zero
advantages even under a random-init model. Seven reward levels rather than fewer: with three, all
samples of both groups of a small step tied about once in 700 runs, and that step's gradient was zero."""

from instar.agents import Env, Result, StepEnvRunner


class LengthEnv(Env):
    async def step(self, state: dict) -> Result:
        reward = float(len(state["action_text"]) % 7) / 6
        return Result(reward=reward, score=reward)


AgentRunner = StepEnvRunner(LengthEnv)

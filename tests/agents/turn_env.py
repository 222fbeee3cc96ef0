"""A three-turn Env that rewards every turn (the turn's length mod 3), with the follow-ups the scripted test model
(tests/helpers/agents.py) was trained on."""

from instar.agents import Env, Result, StepEnvRunner


class TurnEnv(Env):
    async def step(self, state: dict) -> Result:
        reward = float(len(state["action_text"]) % 3)
        if state["turn"] < 2:
            return Result(reward=reward, observation=["Check it.", "Thanks"][state["turn"]], terminated=False)
        return Result(reward=reward)


AgentRunner = StepEnvRunner(TurnEnv)

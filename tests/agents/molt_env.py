"""An Env written as Molt documents it (the runner is a subclass): two turns, the prompt then "Check it.";
each turn earns 1 when the record's label appears in the model's answer. Only the import line is instar's."""

from instar.agents import Env, Result, StepEnvRunner


class LabelTwoTurnEnv(Env):
    async def step(self, state: dict) -> Result:
        found = float(str(state["label"]) in state["action_text"])
        if state["turn"] == 0:
            return Result(reward=found, observation="Check it.", terminated=False, info={"found": found})
        return Result(reward=found, score=found, info={"found": found})


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(LabelTwoTurnEnv)

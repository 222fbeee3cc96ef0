"""Single-turn math: the model answers once; reward 1 when the last number it wrote equals the label.

    instar rl --train.agent_path examples/agents/math_env.py --data.prompt_dataset math.jsonl ...
"""

import re

from instar.agents import Env, Result, StepEnvRunner

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    numbers = NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


class MathEnv(Env):
    async def step(self, state: dict) -> Result:
        answer = last_number(state["action_text"])
        correct = answer is not None and answer == float(state["label"])
        # terminated=True (the default): one turn, no observation.
        return Result(reward=float(correct), score=float(correct), info={"answered": answer is not None})


AgentRunner = StepEnvRunner(MathEnv)

"""Single-turn math: the model answers once; reward 1 when its final answer (its \\boxed{} answer, else
its last expression) equals the label as mathematics: `\\frac{1}{2}`, `1/2` and `0.5` all match "0.5".

    instar rl --train.agent_path examples/agents/math_env.py --data.prompt_dataset math.jsonl ...
"""

import asyncio

from instar.agents import Env, Result, StepEnvRunner
from instar.agents.rewards import math_equal


class MathEnv(Env):
    async def step(self, state: dict) -> Result:
        text = state["action_text"]
        # sympy work in a thread: the runner's other rollouts go on meanwhile
        correct = await asyncio.to_thread(math_equal, text, state["label"])
        # terminated=True (the default): one turn, no observation.
        return Result(reward=float(correct), score=float(correct), info={"boxed": "\\boxed" in text})


AgentRunner = StepEnvRunner(MathEnv)

"""A plain gymnasium.Env with text observations and actions, run through GymEnvRunner: the prompt (from
reset's options), then "Check it."; each step earns 1 when the record's label appears in the action, and
the episode is truncated after two steps (a time limit, as gymnasium's TimeLimit would)."""

import gymnasium

from instar.agents import GymEnvRunner


class LabelGymEnv(gymnasium.Env):
    max_steps = 2

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.label, self.steps = str(options["label"]), 0
        return options["prompt"], {}

    def step(self, action: str):
        self.steps += 1
        reward = float(self.label in action)
        return "Check it.", reward, False, self.steps >= self.max_steps, {"step": self.steps}


AgentRunner = GymEnvRunner(LabelGymEnv)

"""``AgentRunner = GymEnvRunner(MyGymEnv)``: a plain Gymnasium-style env with text observations and
actions, run by the ``StepEnvRunner`` loop (same transcript, same token budgets).

Per rollout: ``MyGymEnv()``, then ``reset(seed=None, options={"prompt": <prompt text>, "label": <label>})``.
Its observation is the first user turn; when it is None or "" the dataset prompt is. Each sampled turn's
text goes to ``step(action)``; rewards are summed, ``terminated`` or ``truncated`` ends the rollout, and
otherwise the observation is the next user turn. ``close()`` runs when the rollout ends. The env's
methods are synchronous, so each runs in a worker thread: the event loop also serves the chat server.
Duck typed: gymnasium itself is not imported.
"""

from __future__ import annotations

import asyncio
from typing import Any

from instar.agents.api import Env, StepEnvRunner
from instar.contract import Result


def _text(observation: Any, where: str) -> str:
    if not isinstance(observation, str):
        raise TypeError(f"{where} must return a text (str) observation for GymEnvRunner, got "
                        f"{type(observation).__name__}; render the observation as text")
    return observation


class _GymAdapter(Env):
    gym_class: type
    env: Any = None  # the gym env instance, made in reset

    async def reset(self, state: dict) -> dict:
        self.env = await asyncio.to_thread(self.gym_class)
        options = {"prompt": state["observation_text"], "label": state["label"]}
        observation, _ = await asyncio.to_thread(self.env.reset, seed=None, options=options)
        text = "" if observation is None else _text(observation, f"{self.gym_class.__name__}.reset")
        return {"observation": text} if text else {}

    async def step(self, state: dict) -> Result:
        observation, reward, terminated, truncated, info = await asyncio.to_thread(self.env.step, state["action_text"])
        observation = "" if terminated or truncated else _text(observation, f"{self.gym_class.__name__}.step")
        return Result(reward=float(reward), observation=observation, terminated=bool(terminated),
                      truncated=bool(truncated), info=info or {})

    async def close(self) -> None:
        if self.env is not None:
            await asyncio.to_thread(self.env.close)


class GymEnvRunner(StepEnvRunner):
    """Runs a Gymnasium-style env class (``reset`` / ``step`` / ``close``): one new instance per rollout."""

    def __init__(self, gym_env_class: type) -> None:
        if not (isinstance(gym_env_class, type) and all(callable(getattr(gym_env_class, m, None))
                                                        for m in ("reset", "step", "close"))):
            raise TypeError(f"GymEnvRunner takes a class with reset(seed=, options=), step(action) and close() "
                            f"(e.g. a gymnasium.Env subclass; the class, not an instance), got {gym_env_class!r}")
        super().__init__(type(f"Gym{gym_env_class.__name__}", (_GymAdapter,), {"gym_class": gym_env_class}))

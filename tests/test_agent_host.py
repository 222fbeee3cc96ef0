"""AgentHost drops a rollout whose prompt cannot fit, with its own reason (not as a broken record)."""

import asyncio
from pathlib import Path

from transformers import AutoTokenizer

from instar.agents.api import Task, load_agent
from instar.agents.host import AgentHost
from instar.engines.embedded import EmbeddedEngine

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/agents/math_env.py"


def test_prompt_longer_than_max_len_is_dropped_as_prompt_too_long(tiny_model_dir):
    async def go():
        engine = EmbeddedEngine.from_pretrained(tiny_model_dir)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        async with AgentHost(load_agent(str(EXAMPLE)), engine, tokenizer, max_len=8, max_new_tokens=4,
                             agent_timeout=30) as host:
            traj = await host.rollout(Task(prompt="What is 12*34+5? " * 3, label="413", rollout_id="r"))
        await engine.close()
        return traj, host.metrics()

    traj, metrics = asyncio.run(go())
    assert traj is None
    assert metrics == {"agent/finished": 0.0, "agent/dropped_prompt_too_long": 1.0}

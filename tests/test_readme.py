"""The README's agent examples are real: extracted, loaded as agent modules, and run for one rollout
each against the embedded engine on the tiny model. The files, flags and snippets of every page, the README's
included, are checked in test_docs.py."""

import asyncio
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from instar.agents.api import Task, load_agent
from instar.agents.host import AgentHost
from instar.contract import SamplingParams
from instar.engines.embedded import EmbeddedEngine

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks() -> dict[str, str]:
    found = re.findall(r"```python\n# (\w+\.py)[^\n]*\n(.*?)```", README.read_text(), re.S)
    return {name: code for name, code in found}


def test_readme_has_both_agent_forms():
    assert set(blocks()) == {"my_env.py", "my_agent.py"}
    for code in blocks().values():
        assert len(code.splitlines()) <= 30


@pytest.mark.parametrize("name", ["my_env.py", "my_agent.py"])
def test_readme_agent_runs_a_rollout(name, tmp_path, tiny_model_dir):
    path = tmp_path / name
    path.write_text(blocks()[name])
    runner = load_agent(str(path))

    async def one_rollout():
        engine = EmbeddedEngine.from_pretrained(tiny_model_dir)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        async with AgentHost(runner, engine, tokenizer, max_len=256, max_new_tokens=8, agent_timeout=60) as host:
            task = Task(prompt="What is 2+3?", label="5", rollout_id="r0", sampling_params=SamplingParams(seed=1))
            traj = await host.rollout(task)
        await engine.close()
        return traj, host.metrics()

    traj, metrics = asyncio.run(one_rollout())
    assert traj is not None, metrics
    traj.validate()
    # The reward is the README agent's rule applied to what the model actually said in this rollout
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    replies = [tokenizer.decode(span, skip_special_tokens=True) for span in action_spans(traj)]
    if name == "my_env.py":
        numbers = re.findall(r"-?\d+", replies[-1])
        assert traj.reward == float(bool(numbers) and numbers[-1] == "5")
    else:
        assert traj.reward == float(any("5" in r for r in replies))
        assert traj.reward == 1.0 or len(replies) == 3  # three tries before giving up


def action_spans(traj) -> list[list[int]]:
    """The sampled turns: each maximal run of action tokens, in order."""
    spans: list[list[int]] = []
    for seg in traj.segments:
        for i, (token, action) in enumerate(zip(seg.token_ids, seg.action_mask)):
            if action and (i == 0 or not seg.action_mask[i - 1]):
                spans.append([])
            if action:
                spans[-1].append(token)
    return spans

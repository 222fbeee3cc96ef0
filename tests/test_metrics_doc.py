"""docs/metrics.md lists every metric a real run logs: each key of each metrics.jsonl row of a short `instar rl` run
(critic, reference, dynamic filter, agent info, a final eval) is a documented key, or fits a documented family; every
fraction, rate and ratio in it lies in [0, 1]."""

import json
import re

import pytest
from helpers.loop import ROOT, make_cfg, rows

from instar.loop import run

AGENT = """
from instar.agents import Env, Result, StepEnvRunner


class InfoEnv(Env):
    async def step(self, state):
        n = len(state["action_text"])
        return Result(reward=n % 7 / 6, info={"chars": n, "long": n > 20})


AgentRunner = StepEnvRunner(InfoEnv)
"""


def documented() -> re.Pattern:
    """The `keys` in the first column of the page's "| key |" tables, as one pattern: a `<...>` placeholder matches
    any name."""
    tables = re.findall(r"^\| key \|.*\n\|[-| ]+\n((?:\|.*\n)+)", (ROOT / "docs/metrics.md").read_text(), re.M)
    cells = [row.split("|")[1] for table in tables for row in table.splitlines()]
    keys = [key for cell in cells for key in re.findall(r"`([^`]+)`", cell)]
    return re.compile("|".join(".+".join(map(re.escape, re.split(r"<[^>]+>", key))) for key in keys))


@pytest.mark.slow
def test_every_logged_metric_is_documented(tmp_path, tiny_model_dir, prompts):
    agent, eval_set = tmp_path / "info_env.py", tmp_path / "eval.jsonl"
    agent.write_text(AGENT)
    eval_set.write_text("".join(json.dumps({"prompt": f"Say {i}.", "label": str(i)}) + "\n" for i in range(4)))
    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{
        "train.agent_path": str(agent), "train.max_steps": 2, "algo.dynamic_filter": (0.0, 1.0),
        "eval.dataset": str(eval_set), "eval.n_samples": 2})
    cfg.algo.advantage.estimator, cfg.algo.kl.coef = "gae", 0.01  # a critic and a reference
    run(cfg)
    logged = rows(tmp_path / "run/metrics.jsonl")
    keys = {key for row in logged for key in row}
    assert [row["step"] for row in logged] == [1, 2, 2]  # the final eval comes in a second row for the last step
    assert {"actor/ref_kl", "dynamic_filter/pass_rate", "info/long/mean", "eval/pass@2", "critic/value_loss",
            "weight_sync/bytes"} <= keys
    pattern = documented()
    assert sorted(key for key in keys if not pattern.fullmatch(key)) == []
    fractions = {key for key in keys if key.endswith(("_fraction", "_rate", "_ratio"))}  # every one is a fraction
    assert {"engine/idle_fraction", "engine/prefix_hit_rate", "agent/cpu_fraction", "truncation_rate"} <= fractions
    assert [(row["step"], key, row[key]) for row in logged for key in sorted(fractions & row.keys())
            if not 0 <= row[key] <= 1] == []

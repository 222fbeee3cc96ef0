"""What the end-to-end tests of the RL loop share: a small run's config on the tiny model, the JSON rows a run
writes, and a thread that kills one of the run's actors at a given moment."""

import json
import threading
import time
from pathlib import Path

import ray

from instar.config import RLConfig

ROOT = Path(__file__).resolve().parents[2]


def make_cfg(tmp_path, model, prompts, **changes) -> RLConfig:
    """3 steps of 2 prompts x 4 samples with tests/agents/length_env.py, writing to ``tmp_path``/run;
    ``changes`` maps "section.field" to a value."""
    cfg = RLConfig()
    cfg.actor.model_name_or_path = str(model)
    cfg.actor.learning_rate = 1e-3
    cfg.data.prompt_dataset = prompts
    cfg.data.max_new_tokens = 24
    cfg.data.max_len = 256
    cfg.train.agent_path = str(ROOT / "tests/agents/length_env.py")
    cfg.train.max_steps = 3
    cfg.rollout.batch_size = 2
    cfg.rollout.n_samples_per_prompt = 4
    cfg.rollout.max_groups_in_flight = 4
    cfg.ckpt.output_dir = str(tmp_path / "run")
    for path, value in changes.items():
        section, leaf = path.split(".")
        setattr(getattr(cfg, section), leaf, value)
    return cfg


def rows(path) -> list[dict]:
    """The rows of a JSONL file a run wrote (metrics.jsonl, ledger.jsonl, eval.jsonl)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def kill_when(ready, actor, restart: bool = True) -> list[float]:
    """From a thread, kill ``actor()`` once ``ready()``; the returned list gets the kill's time."""
    killed: list[float] = []

    def watch():
        deadline = time.monotonic() + 240
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        killed.append(time.monotonic())
        ray.kill(actor(), no_restart=not restart)

    threading.Thread(target=watch, daemon=True).start()
    return killed


def logged(path, step: int):
    """A ``ready`` for kill_when: the metrics file at ``path`` holds ``step`` rows."""
    return lambda: path.exists() and len(path.read_text().splitlines()) >= step

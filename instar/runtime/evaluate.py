"""`--eval.*`: accuracy and pass@k of the current policy over an eval set, through the same agents."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tqdm import tqdm

from instar.agents.api import Task
from instar.config import RLConfig
from instar.contract import SamplingParams, Trajectory, write_jsonl
from instar.data.prompts import load_prompts
from instar.data.records import Subset
from instar.runtime.pool import group_tasks


async def evaluate(agents: list[Any], cfg: RLConfig, sampling: SamplingParams, step: int = 0) -> dict[str, float]:
    """Accuracy (mean score) and pass@k over --eval.dataset at --eval.temperature, plus greedy
    accuracy; the trajectories go to --eval.dump_dir when set."""
    e = cfg.eval
    prompts = load_prompts(e.dataset, cfg.data, e.split, "eval.dataset", Subset(e.dataset_config, e.dataset_revision,
                                                                              e.data_files))
    out, dumped = {}, []
    with tqdm(total=2 * len(prompts), desc=f"eval step {step}", unit="group", leave=False, dynamic_ncols=True) as bar:

        async def run(i: int, group: list[Task]) -> list[Trajectory]:
            trajs = await agents[i % len(agents)].run_group.remote(group)
            bar.update(1)
            return trajs

        for name, temp, k in (("eval", cfg.eval.temperature, cfg.eval.n_samples), ("eval_greedy", 0.0, 1)):
            params = sampling.replace(temperature=temp)
            groups = [group_tasks(p, p.index, k, params, f"{name}-{p.index}-") for p in prompts]
            results = await asyncio.gather(*(run(i, g) for i, g in enumerate(groups)))
            dumped += [t for trajs in results for t in trajs]
            scores = [[t.outcome for t in trajs] for trajs in results]
            n = sum(len(s) for s in scores)
            out[f"{name}/accuracy"] = sum(map(sum, scores)) / max(n, 1)
            out[f"{name}/pass@{k}"] = sum(any(x >= 1.0 for x in s) for s in scores) / len(prompts)
            out[f"{name}/dropped"] = float(len(prompts) * k - n)
    if cfg.eval.dump_dir:
        path = Path(cfg.eval.dump_dir) / f"eval_step_{step:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a resumed run evaluates this step again
        write_jsonl(str(path), dumped)
    return out

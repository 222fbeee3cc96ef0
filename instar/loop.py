"""The RL loop. Read this file first.

    batch of finished prompt groups -> filter -> reference / critic passes (and the policy's own, when
    the advantages need it) -> advantages -> policy (and critic) updates, one per mini-batch of
    --train.batch_size samples -> weight sync to the engines -> ledger, metrics -> checkpoint -> eval

Generation never waits for training except at the staleness bound (`RolloutPool`); with
`--train.force_sync_mode` the pool refills only after the weight sync, which makes every step
strictly on-policy.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

from instar.algo import KLController
from instar.checks import check
from instar.config import ConfigError, RLConfig
from instar.contract import SamplingParams, Trajectory, write_jsonl
from instar.data.prompts import PromptStream, load_prompts
from instar.runtime import batching
from instar.runtime.cluster import Cluster
from instar.runtime.metrics import MetricsLogger
from instar.runtime.pool import Group, ReplayPool, RolloutPool
from instar.train import checkpoint
from instar.train.batch import StepInputs


def run(cfg: RLConfig) -> dict[str, float]:
    """Train until --train.max_steps; returns the last step's metrics."""
    check(cfg)
    return asyncio.run(_run(cfg))


def evaluate(cfg: RLConfig) -> dict[str, float]:
    """`instar eval`: --eval.dataset through the agent with --actor.model_name_or_path; no training."""
    if not cfg.eval.dataset:
        raise ConfigError("--eval.dataset is required: the prompts (with labels) to evaluate on")
    if not cfg.train.agent_path:
        raise ConfigError("--train.agent_path is required: the agent (Env or ChatAgent) that scores each answer")

    async def go() -> dict[str, float]:
        async with Cluster(cfg, train=False) as cluster:
            return await cluster.evaluate(cfg, sampling_params(cfg))
    return asyncio.run(go())


def sampling_params(cfg: RLConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=cfg.data.max_new_tokens)


async def _run(cfg: RLConfig) -> dict[str, float]:
    out = Path(cfg.ckpt.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1, default=str))
    stream = PromptStream(load_prompts(cfg.data.prompt_dataset, cfg.data), cfg.actor.seed, cfg.data.shuffle)
    kl = KLController.from_config(cfg.algo.kl)
    async with Cluster(cfg) as cluster:
        step, pending = await resume(cfg, cluster, stream, kl)
        r, sampling = cfg.rollout, sampling_params(cfg)
        if cfg.train.rollout_replay_dir:
            pool = ReplayPool(cfg.train.rollout_replay_dir, step)
        else:
            pool = RolloutPool(cluster.agents, stream, cfg, sampling)
            pool.done, pool.version = pending, step
        logger = MetricsLogger(out, cfg.log, cfg.train.max_steps, step, asdict(cfg))
        logger.truncate_after(step)
        if cfg.eval.dataset and step == 0 and cluster.agents:
            logger.log(0, await cluster.evaluate(cfg, sampling))
        def eval_due(step: int) -> bool:
            return bool(cfg.eval.dataset and cluster.agents and cfg.eval.steps and step % cfg.eval.steps == 0)

        metrics: dict[str, float] = {}
        barren = 0  # consecutive batches in which every rollout was dropped
        while step < cfg.train.max_steps:
            t0 = time.perf_counter()
            groups = await pool.next_batch(r.batch_size)
            t_gen = time.perf_counter()
            kept, metrics = batching.select(groups, cfg)
            if not kept:  # everything filtered or dropped: nothing to learn from, draw again
                mark(stream, out, step, groups, "filtered")
                barren = barren + 1 if metrics.get("dropped/empty_group") == len(groups) else 0
                if barren == 3:
                    raise RuntimeError(f"every rollout of 3 batches in a row was dropped; agent-runner counts: "
                                       f"{await cluster.metrics()} (see the agent runners' log for the errors)")
                continue
            barren = 0
            rows = batching.to_rows(kept)
            # Trainer logprobs of the distribution the engine sampled from (temperature applied), unless
            # the engine reports raw ones: the IS ratio compares the two.
            temp = r.temperature if cfg.vllm.logprobs_mode == "processed" else 1.0
            # A separate pre-update pass only when the advantages need it; otherwise the trainer takes
            # the "old" logprobs from its first update's own forward.
            old = await cluster.trainer.compute_logprobs(rows.samples, temp) if batching.needs_old(cfg) else None
            ref = await cluster.trainer.compute_logprobs(rows.samples, temp, "ref") if cluster.has_ref else None
            values = await cluster.trainer.compute_values(rows.samples) if cluster.has_critic else None
            t_logp = time.perf_counter()
            adv, returns, adv_metrics = batching.advantages(cfg, rows, old, ref, values, kl.value)
            updates = batching.mini_batches(rows, cfg, step)
            inputs = StepInputs(advantages=adv, old_logprobs=old, ref_logprobs=ref)
            loss_fn = partial(batching.rl_loss, cfg, kl.value)
            stats = await cluster.trainer.train_policy(rows.samples, loss_fn, inputs, temp, updates)
            metrics |= stats.metrics
            if values is not None:
                metrics |= await cluster.critic_step(rows.samples, values, returns, updates)
            t_train = time.perf_counter()
            step += 1
            metrics |= await cluster.sync_weights(step, keep_in_flight=cfg.train.partial_rollout_enable)
            pool.version = step
            if cfg.train.force_sync_mode:
                pool.fill()
            t_sync = time.perf_counter()
            if stats.ref_kl is not None:
                kl.update(stats.ref_kl, len(rows.trajectories))
            mark(stream, out, step, kept, "trained")
            mark(stream, out, step, [g for g in groups if all(g is not k for k in kept)], "filtered")
            if cfg.train.rollout_dump_dir:
                Path(cfg.train.rollout_dump_dir).mkdir(parents=True, exist_ok=True)
                write_jsonl(f"{cfg.train.rollout_dump_dir}/step_{step:06d}.jsonl", rows.trajectories)
            metrics |= adv_metrics | batching.rollout_metrics(rows.trajectories, step - 1) | await cluster.metrics()
            # trainer_idle: waiting for finished rollouts (generation that did not overlap training)
            metrics |= {"kl_coef": kl.value, "time/trainer_idle": t_gen - t0, "time/logprobs": t_logp - t_gen,
                        "time/train": t_train - t_logp, "time/weight_sync": t_sync - t_train,
                        "time/step": t_sync - t0,
                        "tokens_per_second": sum(len(s.token_ids) for s in rows.samples) / max(t_sync - t0, 1e-9)}
            if eval_due(step):
                metrics |= await cluster.evaluate(cfg, sampling, step)
            logger.log(step, metrics)
            if (cfg.ckpt.save_steps and step % cfg.ckpt.save_steps == 0) or step == cfg.train.max_steps:
                await save(cfg, cluster, step, stream, kl, pool.pending())
            if cfg.ckpt.hf_save_steps and step % cfg.ckpt.hf_save_steps == 0:
                await cluster.trainer.export_hf(str(out / f"hf_step_{step}"))
        if cfg.eval.dataset and cluster.agents and not eval_due(step):  # the final eval, unless just done
            logger.log(step, metrics | await cluster.evaluate(cfg, sampling, step))
        await cluster.trainer.export_hf(str(out / "hf"))
        await pool.close()
        logger.close()
    return metrics


def mark(stream: PromptStream, out: Path, step: int, groups: list[Group], outcome: str) -> None:
    """The data ledger: one line per prompt group with its fate; trained ones are also in the stream."""
    with (out / "ledger.jsonl").open("a") as f:
        for g in groups:
            if outcome == "trained" and g.epoch >= 0:
                stream.mark_trained(g.epoch, g.prompt_index)
            f.write(json.dumps({"step": step, "epoch": g.epoch, "prompt_index": g.prompt_index,
                                "outcome": outcome}) + "\n")


async def save(cfg: RLConfig, cluster: Cluster, step: int, stream: PromptStream, kl: KLController,
               pending: list[Group]) -> None:
    ledger = Path(cfg.ckpt.output_dir) / "ledger.jsonl"
    extra = {"step": step, "stream": stream.state_dict(), "kl": kl.state_dict(),
             "ledger_lines": len(ledger.read_text().splitlines()) if ledger.exists() else 0,
             "pending": [(g.group_id, g.epoch, g.prompt_index, g.launch_version, [t.to_json() for t in g.trajectories])
                         for g in pending]}
    await cluster.trainer.save(str(Path(cfg.ckpt.output_dir) / "checkpoints"), extra, cfg.ckpt.max_num)


async def resume(cfg: RLConfig, cluster: Cluster, stream: PromptStream, kl: KLController) -> tuple[int, list[Group]]:
    """Restore the latest checkpoint when --ckpt.load_enable: weights (pushed to the engines), data
    position, ledger, KL controller, and the rollouts that were generated but not yet trained."""
    path = checkpoint.latest(str(Path(cfg.ckpt.output_dir) / "checkpoints")) if cfg.ckpt.load_enable else None
    if path is None:
        return 0, []
    extra = await cluster.trainer.load(path)
    pending = [Group(gid, epoch, index, version, [Trajectory.from_json(t) for t in trajs])
               for gid, epoch, index, version, trajs in extra["pending"]]
    stream.load_state_dict(extra["stream"], pending=[(g.epoch, g.prompt_index) for g in pending])
    kl.load_state_dict(extra["kl"])
    ledger = Path(cfg.ckpt.output_dir) / "ledger.jsonl"
    if ledger.exists():  # lines written after the checkpoint belong to steps this run redoes
        lines = ledger.read_text().splitlines()[: extra["ledger_lines"]]
        ledger.write_text("".join(line + "\n" for line in lines))
    await cluster.sync_weights(extra["step"], keep_in_flight=False)
    return extra["step"], pending

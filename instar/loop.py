"""The RL loop. Read this file first; docs/design.md draws the same step as one picture.

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
from instar.contract import SamplingParams, write_jsonl
from instar.data.prompts import PromptStream, load_prompts
from instar.runtime import batching
from instar.runtime.cluster import Cluster
from instar.runtime.evaluate import evaluate as evaluate_agents
from instar.runtime.metrics import Usage
from instar.runtime.pool import Group, Pool, PoolState, ReplayPool, RolloutPool
from instar.train import checkpoint, run_dir
from instar.train.batch import StepInputs


def run(cfg: RLConfig) -> dict[str, float]:
    """Train until --train.max_steps; returns the last step's metrics."""
    check(cfg)
    return asyncio.run(_run(cfg))


def evaluate(cfg: RLConfig) -> dict[str, float]:
    """`instar eval`: --eval.dataset through the agent with --actor.model_name_or_path; no training. The
    figures are also appended to --ckpt.output_dir/eval.jsonl (and TensorBoard / W&B when asked)."""
    if not cfg.eval.dataset:
        raise ConfigError("--eval.dataset is required: the prompts (with labels) to evaluate on")
    if not cfg.train.agent_path:
        raise ConfigError("--train.agent_path is required: the agent (Env or ChatAgent) that scores each answer")

    async def go() -> dict[str, float]:
        async with Cluster(cfg, train=False) as cluster:
            return await evaluate_agents(cluster.agents, cfg, sampling_params(cfg))
    metrics = asyncio.run(go())
    logger = run_dir.MetricsLogger(cfg.ckpt.output_dir, cfg.log, 1, run_config=asdict(cfg), job="eval")
    logger.log(0, {"model": cfg.actor.model_name_or_path, **metrics})
    logger.close()
    return metrics


def sampling_params(cfg: RLConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=cfg.data.max_new_tokens)


async def _run(cfg: RLConfig) -> dict[str, float]:
    run_dir.prepare_run_dir(cfg.ckpt)
    out = Path(cfg.ckpt.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1, default=str))
    stream = PromptStream(load_prompts(cfg.data.prompt_dataset, cfg.data), cfg.actor.seed, cfg.data.shuffle)
    kl = KLController.from_config(cfg.algo.kl)
    r, sampling = cfg.rollout, sampling_params(cfg)
    async with Cluster(cfg) as cluster:
        step, pool_state = await resume(cfg, cluster, stream, kl)
        pool: Pool = (ReplayPool(cfg.train.rollout_replay_dir, step) if cfg.train.rollout_replay_dir
                      else RolloutPool(cluster.agents, stream, cfg, sampling, pool_state,
                                       cluster.generation and cluster.generation.set))
        usage = Usage(cluster.agents, cluster.engines)
        logger = run_dir.MetricsLogger(out, cfg.log, cfg.train.max_steps, step, asdict(cfg))
        logger.truncate_after(step if step else -1)  # a run resumed at 0 evaluates step 0 again

        def eval_due(step: int) -> bool:
            return bool(cfg.eval.dataset and cluster.agents and cfg.eval.steps and step % cfg.eval.steps == 0)

        if eval_due(0) and step == 0:
            logger.log(0, await evaluate_agents(cluster.agents, cfg, sampling))
        metrics: dict[str, float] = {}
        barren = 0  # consecutive batches that left nothing to train on
        syncing: asyncio.Future | None = None  # the last step's weight sync, while it runs
        while step < cfg.train.max_steps:
            t0 = time.perf_counter()
            groups = await pool.next_batch(r.batch_size)
            t_gen = time.perf_counter()
            kept, rejected, metrics = batching.select(groups, cfg)
            mark(stream, out, step + 1, rejected, "filtered")
            if not kept:  # everything filtered or dropped: nothing to learn from, draw again
                barren += 1
                await finished(syncing)  # before another sync; no row is logged for a dropped batch
                syncing = None
                pool.weights_updated()  # the dropped batch no longer holds generation back
                await cluster.restore_engines(step)  # a restarted sole engine serves only once it has weights
                why = barren_reason(metrics, await usage.read())
                logger.note(f"step {step + 1}: nothing to train on in batch {barren} in a row: {why}")
                if barren == cfg.train.max_barren_batches:
                    raise RuntimeError(f"{barren} rollout batches in a row left nothing to train on "
                                       f"(--train.max_barren_batches); the last: {why}")
                continue
            barren = 0
            rows = batching.to_rows(kept)
            if cfg.engine.enable_sleep_mode:  # sync mode: nothing is generated until the weight sync wakes them
                await cluster.sleep_engines()
            # Trainer logprobs of the distribution the engine sampled from (temperature applied), unless
            # the engine reports raw ones: the IS ratio compares the two.
            temp = r.temperature if cfg.engine.logprobs_mode == "processed" else 1.0
            # A separate pre-update pass only when the advantages need it; otherwise the trainer takes
            # the "old" logprobs from its first update's own forward.
            old = await cluster.trainer.compute_logprobs(rows.samples, temp) if batching.needs_old(cfg) else None
            ref = await cluster.trainer.compute_logprobs(rows.samples, temp, "ref") if cluster.has_ref else None
            values = await cluster.trainer.compute_values(rows.samples) if cluster.has_critic else None
            t_logp = time.perf_counter()
            adv, returns, adv_metrics = batching.advantages(cfg, rows, old, ref, values, kl.value)
            updates = batching.mini_batches(rows, cfg, step)
            idle = batching.forward_only(cfg, rows.samples, adv, kl.value)
            stats = await cluster.trainer.train_policy(
                rows.samples, partial(batching.rl_loss, cfg, kl.value),
                StepInputs(advantages=adv, old_logprobs=old, ref_logprobs=ref), temp, updates, idle)
            metrics |= stats.metrics | {"actor/forward_only": len(idle) / len(rows.samples)}
            if values is not None:
                critic = await cluster.trainer.train_critic(rows.samples, partial(batching.critic_loss, cfg),
                                                            StepInputs(old_values=values, returns=returns), updates)
                metrics |= critic.metrics
            t_train = time.perf_counter()
            step += 1
            # The new weights go to the engines while the next batch trains (when generation may run ahead);
            # the pool runs ahead again once they are there. The sync's figures join the row of the step it ends in.
            metrics |= await finished(syncing)
            syncing = await sync_weights(cluster, pool, step, cfg)
            if cfg.train.force_sync_mode or cfg.train.async_queue_size == 0:  # nothing can overlap it
                metrics |= await finished(syncing)
                syncing = None
            t_sync = time.perf_counter()
            if stats.ref_kl is not None:
                kl.update(stats.ref_kl, len(rows.trajectories))
            mark(stream, out, step, kept, "trained")
            if cfg.train.rollout_dump_dir:
                Path(cfg.train.rollout_dump_dir).mkdir(parents=True, exist_ok=True)
                write_jsonl(f"{cfg.train.rollout_dump_dir}/step_{step:06d}.jsonl", rows.trajectories)
            metrics |= (adv_metrics | batching.rollout_metrics(rows.trajectories, step - 1) | await usage.read()
                        | pool.metrics())
            # trainer_idle: waiting for finished rollouts (generation that did not overlap training)
            metrics |= {"kl_coef": kl.value, "time/trainer_idle": t_gen - t0, "time/logprobs": t_logp - t_gen,
                        "time/train": t_train - t_logp, "time/weight_sync": t_sync - t_train,
                        "time/step": t_sync - t0,
                        "tokens_per_second": sum(len(s.token_ids) for s in rows.samples) / max(t_sync - t0, 1e-9)}
            if eval_due(step) or step == cfg.train.max_steps:  # the engines must hold this step's weights
                metrics |= await finished(syncing)
                syncing = None
            if eval_due(step):
                metrics |= await evaluate_agents(cluster.agents, cfg, sampling, step)
            logger.log(step, metrics)
            if (cfg.ckpt.save_steps and step % cfg.ckpt.save_steps == 0) or step == cfg.train.max_steps:
                await save(cfg, cluster, step, stream, kl, pool.state())
            if cfg.ckpt.hf_save_steps and step % cfg.ckpt.hf_save_steps == 0:
                await cluster.trainer.export_hf(str(out / f"hf_step_{step}"))
        if cfg.eval.dataset and cluster.agents and not eval_due(step):  # the final eval, unless just done
            logger.log(step, metrics | await evaluate_agents(cluster.agents, cfg, sampling, step))
        await cluster.trainer.export_hf(str(out / "hf"))
        await pool.close()
        logger.close()
    return metrics


async def sync_weights(cluster: Cluster, pool: Pool, step: int, cfg: RLConfig) -> asyncio.Future:
    """Send the policy after ``step`` to the engines. Returns once it is on its way (the trainer's next call
    runs after the send) a future of the sync's figures, done when the engines hold it. The pool launches
    the next groups at once: the engines hold their requests until the new weights are loaded, so the agent
    runners' work and calls overlap the broadcast (it waited for the sync's answer before: ~0.03 s a step)."""
    t0 = time.perf_counter()
    arrival = await cluster.start_sync(step, keep_in_flight=cfg.train.partial_rollout_enable, background=True)
    pool.weights_updated()

    async def arrived() -> dict[str, float]:
        out = await arrival
        return out | {"weight_sync/total_s": time.perf_counter() - t0}
    return asyncio.ensure_future(arrived())


async def finished(syncing: asyncio.Future | None) -> dict[str, float]:
    """A weight sync's figures once it is over (none for no sync)."""
    return {} if syncing is None else await syncing


def barren_reason(metrics: dict[str, float], usage: dict[str, float]) -> str:
    """Why a batch left nothing to train on, from its selection metrics and the agent-runner counts."""
    if "dynamic_filter/pass_rate" in metrics:
        return (f"--algo.dynamic_filter rejected every group (pass rate {metrics['dynamic_filter/pass_rate']:.2f}: "
                "every group scored all the same)")
    drops = {k: v for k, v in usage.items() if k.startswith("agent/dropped_")}
    return f"every rollout was dropped or invalid ({metrics}; agent-runner counts so far: {drops}; see their log)"


def mark(stream: PromptStream, out: Path, step: int, groups: list[Group], outcome: str) -> None:
    """The data ledger: one line per prompt group with its fate, also told to the stream (which then
    does not serve the prompt again this epoch, across resumes too)."""
    with (out / "ledger.jsonl").open("a") as f:
        for g in groups:
            if g.epoch >= 0:  # replayed groups are not drawn from the stream
                (stream.mark_trained if outcome == "trained" else stream.mark_rejected)(g.epoch, g.prompt_index)
            f.write(json.dumps({"step": step, "epoch": g.epoch, "prompt_index": g.prompt_index,
                                "outcome": outcome}) + "\n")


async def save(cfg: RLConfig, cluster: Cluster, step: int, stream: PromptStream, kl: KLController,
               pool: PoolState) -> None:
    ledger = Path(cfg.ckpt.output_dir) / "ledger.jsonl"
    extra = {"step": step, "stream": stream.state_dict(), "kl": kl.state_dict(), "pool": pool.to_json(),
             "ledger_lines": len(ledger.read_text().splitlines()) if ledger.exists() else 0}
    await cluster.trainer.save(str(Path(cfg.ckpt.output_dir) / "checkpoints"), extra, cfg.ckpt.max_num)


async def resume(cfg: RLConfig, cluster: Cluster, stream: PromptStream, kl: KLController) -> tuple[int, PoolState]:
    """Restore the latest checkpoint when --ckpt.load_enable: weights (pushed to the engines), data
    position, ledger, KL controller, and the rollouts that were generated but not yet trained."""
    path = checkpoint.latest(str(Path(cfg.ckpt.output_dir) / "checkpoints")) if cfg.ckpt.load_enable else None
    extra = await cluster.trainer.load(path) if path else {"step": 0, "ledger_lines": 0}
    # What was written after the checkpoint (or by a run that died before its first) is redone now
    run_dir.truncate_lines(Path(cfg.ckpt.output_dir) / "ledger.jsonl", extra["ledger_lines"])
    run_dir.truncate_dumps(cfg.train.rollout_dump_dir, extra["step"])
    if path is None:
        return 0, PoolState()
    pool = PoolState.from_json(extra["pool"])
    stream.load_state_dict(extra["stream"], pending=[(g.epoch, g.prompt_index) for g in pool.pending])
    kl.load_state_dict(extra["kl"])
    await cluster.sync_weights(extra["step"], keep_in_flight=False)
    return extra["step"], pool

"""The RL loop. Read this file first; docs/design.md draws the same step as one picture.

    batch of finished prompt groups -> filter -> reference / critic passes (and the policy's own, when
    the advantages need it) -> advantages -> policy (and critic) updates, one per mini-batch of
    --train.batch_size samples -> weight sync to the engines -> ledger, metrics -> checkpoint -> eval

Generation never waits for training except at the staleness bound (`RolloutPool`); with
`--train.force_sync_mode` the pool refills only after the weight sync, which makes every step
strictly on-policy. When the loop waits for a weight sync, and how the engines take it, is `SyncPlan`'s
decision (runtime/cluster.py).
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from instar.algo import KLController
from instar.config import RLConfig
from instar.contract import SamplingParams, Trajectory, write_jsonl
from instar.data.chat import load_tokenizer
from instar.data.prompts import PromptStream, drop_overlong, load_prompts
from instar.runtime import batching
from instar.runtime.cluster import Cluster
from instar.runtime.evaluate import evaluate as evaluate_agents
from instar.runtime.metrics import Usage
from instar.runtime.pool import Group, Pool, PoolState, ReplayPool, RolloutPool
from instar.train import checkpoint, run_dir
from instar.train.batch import StepInputs


def run(cfg: RLConfig, dataset: Any = None, reward_fns: Sequence[Callable[..., Any]] = ()) -> dict[str, float]:
    """Train until --train.max_steps; returns the last step's metrics. ``dataset``: prompt records given from
    Python (`instar.rl`) instead of --data.prompt_dataset; ``reward_fns``: reward functions as callables.
    The settings are checked by the caller (`instar.rl`, before Ray is imported: `instar.checks.check`)."""
    return asyncio.run(_run(cfg, dataset, reward_fns))


def evaluate(cfg: RLConfig) -> dict[str, float]:
    """`instar eval`: --eval.dataset through the agent with --actor.model_name_or_path; no training (the settings
    are checked by the caller, `instar.evaluate`). The figures are also appended to --ckpt.output_dir/eval.jsonl
    (and TensorBoard / W&B when asked)."""

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
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=cfg.data.max_new_tokens,
                          seed=cfg.actor.seed)


async def _run(cfg: RLConfig, dataset: Any, reward_fns: Sequence[Callable[..., Any]]) -> dict[str, float]:
    out = output_dir(cfg)
    data = cfg.data
    tokenizer = load_tokenizer(cfg.actor.model_name_or_path, data.chat_template, data.chat_template_kwargs)
    prompts = drop_overlong(load_prompts(data.prompt_dataset if dataset is None else dataset, data), tokenizer,
                            data.max_len)
    stream = PromptStream(prompts, cfg.actor.seed, cfg.data.shuffle)
    kl = KLController.from_config(cfg.algo.kl)
    sampling = sampling_params(cfg)
    async with Cluster(cfg, reward_fns=reward_fns) as cluster:
        step, pool_state = await resume(cfg, cluster, stream, kl)
        pool: Pool = (ReplayPool(cfg.train.rollout_replay_dir, step) if cfg.train.rollout_replay_dir
                      else RolloutPool(cluster.agents, stream, cfg, sampling, pool_state,
                                       cluster.generation and cluster.generation.set))
        sync, usage = WeightSync(cluster, pool), Usage(cluster.agents, cluster.engines)
        stop = _on_sigterm()
        logger = run_dir.MetricsLogger(out, cfg.log, cfg.train.max_steps, step, asdict(cfg))
        if eval_due(cfg, cluster, 0) and step == 0:
            logger.log(0, await evaluate_agents(cluster.agents, cfg, sampling))
        metrics: dict[str, float] = {}
        barren = 0  # consecutive batches that left nothing to train on
        while step < cfg.train.max_steps:
            t0 = time.perf_counter()
            groups = await pool.next_batch(cfg.rollout.batch_size)
            t_gen = time.perf_counter()
            kept, rejected, metrics = batching.select(groups, cfg)
            mark(stream, out, step + 1, rejected, "filtered")
            if not kept:  # everything filtered or dropped: nothing to learn from, draw again
                barren += 1
                await sync.batch_dropped(step)
                note_barren(cfg, logger, step + 1, barren, barren_reason(metrics, await usage.read()))
                continue
            barren = 0
            rows = batching.to_rows(kept)
            metrics |= await train(cfg, cluster, kl, rows, step, t_gen)
            t_train = time.perf_counter()
            step += 1
            # The new weights go to the engines while the next batch trains (when generation may run ahead);
            # the pool runs ahead again once they are there. The sync's figures join the row of the step it ends in.
            metrics |= await sync.send(step)
            t_sync = time.perf_counter()
            mark(stream, out, step, kept, "trained")
            dump(cfg, step, rows.trajectories)
            metrics |= batching.rollout_metrics(rows.trajectories, step - 1) | await usage.read() | pool.metrics()
            # trainer_idle: waiting for finished rollouts (generation that did not overlap training)
            metrics |= {"kl_coef": kl.value, "time/trainer_idle": t_gen - t0, "time/weight_sync": t_sync - t_train,
                        "time/step": t_sync - t0,
                        "tokens_per_second": sum(len(s.token_ids) for s in rows.samples) / max(t_sync - t0, 1e-9)}
            if eval_due(cfg, cluster, step) or step == cfg.train.max_steps:  # the engines must hold this step's weights
                metrics |= await sync.finish()
            if eval_due(cfg, cluster, step):
                metrics |= await evaluate_agents(cluster.agents, cfg, sampling, step)
            logger.log(step, metrics)
            await save_due(cfg, cluster, step, stream, kl, pool, now=stop.is_set())
            if stop.is_set():
                print(f"instar: SIGTERM: stopped after step {step}, saved; resume with --ckpt.load_enable true")
                raise SystemExit(128 + signal.SIGTERM)
        if cfg.eval.dataset and cluster.agents and not eval_due(cfg, cluster, step):  # the final eval, unless just done
            logger.log(step, metrics | await evaluate_agents(cluster.agents, cfg, sampling, step))
        await cluster.trainer.export_hf(str(out / "hf"))
        await pool.close()
        logger.close()
    return metrics


def output_dir(cfg: RLConfig) -> Path:
    """--ckpt.output_dir, ready for this run, with the run's config in it."""
    run_dir.prepare_run_dir(cfg.ckpt)
    out = Path(cfg.ckpt.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1, default=str))
    return out


def eval_due(cfg: RLConfig, cluster: Cluster, step: int) -> bool:
    return bool(cfg.eval.dataset and cluster.agents and cfg.eval.steps and step % cfg.eval.steps == 0)


async def train(cfg: RLConfig, cluster: Cluster, kl: KLController, rows: batching.Rows, step: int,
                t_gen: float) -> dict[str, float]:
    """The step after ``step``, on one batch: the passes the advantages need, the advantages, one policy (and
    critic) update per mini-batch, the KL controller. Returns its metrics, with the time the passes (since
    ``t_gen``, when the batch was handed out) and the updates took."""
    if cfg.engine.enable_sleep_mode:  # sync mode: nothing is generated until the weight sync wakes them
        await cluster.sleep_engines()
    # Trainer logprobs of the distribution the engine sampled from (temperature applied), unless
    # the engine reports raw ones: the IS ratio compares the two.
    temp = cfg.rollout.temperature if cfg.engine.logprobs_mode == "processed" else 1.0
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
        StepInputs(advantages=adv, old_logprobs=old, ref_logprobs=ref, seq_weights=batching.seq_weights(cfg, rows)),
        temp, updates, idle)
    metrics = stats.metrics | {"actor/forward_only": len(idle) / len(rows.samples)}
    if values is not None:
        critic = await cluster.trainer.train_critic(rows.samples, partial(batching.critic_loss, cfg),
                                                    StepInputs(old_values=values, returns=returns), updates)
        metrics |= critic.metrics
    t_train = time.perf_counter()
    if stats.ref_kl is not None:
        kl.update(stats.ref_kl, len(rows.trajectories))
    return metrics | adv_metrics | {"time/logprobs": t_logp - t_gen, "time/train": t_train - t_logp}


class WeightSync:
    """The run's weight syncs, one at a time, carried out as `cluster.plan` says. Whatever it says, the loop
    awaits the running one before an evaluation and at the last step: the engines must hold that step's
    weights."""

    def __init__(self, cluster: Cluster, pool: Pool):
        self.cluster, self.pool = cluster, pool
        self.running: asyncio.Future | None = None  # the last step's sync, while it runs

    async def send(self, step: int) -> dict[str, float]:
        """Send the policy after ``step`` to the engines. Returns the figures of the syncs that ended: the last
        step's (awaited first) and this one's when the plan waits for it. The pool launches the next groups
        once the sync is on its way: the engines hold their requests until the new weights are loaded, so the
        agent runners' work and calls overlap the broadcast (it waited for the sync's answer before: ~0.03 s a
        step)."""
        figures = await self.finish()
        t0 = time.perf_counter()
        plan = self.cluster.plan
        arrival = await self.cluster.start_sync(step, plan.in_flight, plan.background)
        self.pool.weights_updated()

        async def arrived() -> dict[str, float]:
            return await arrival | {"weight_sync/total_s": time.perf_counter() - t0}
        self.running = asyncio.ensure_future(arrived())
        return figures | (await self.finish() if plan.wait else {})

    async def finish(self) -> dict[str, float]:
        """The running sync's figures once it is over (none when none runs)."""
        running, self.running = self.running, None
        return {} if running is None else await running

    async def batch_dropped(self, step: int) -> None:
        """A batch left nothing to train on: it no longer holds generation back, and a restarted engine gets the
        weights of ``step`` now (with one engine, nothing is generated until then). The running sync ends
        first (one at a time); no row is logged for a dropped batch, so its figures go too."""
        await self.finish()
        self.pool.weights_updated()
        await self.cluster.restore_engines(step)


def note_barren(cfg: RLConfig, logger: run_dir.MetricsLogger, step: int, barren: int, why: str) -> None:
    """Say that the ``barren``-th batch in a row for ``step`` left nothing to train on, and why; stop the run
    at --train.max_barren_batches."""
    logger.note(f"step {step}: nothing to train on in batch {barren} in a row: {why}")
    if barren == cfg.train.max_barren_batches:
        raise RuntimeError(f"{barren} rollout batches in a row left nothing to train on "
                           f"(--train.max_barren_batches); the last: {why}")


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


def dump(cfg: RLConfig, step: int, trajectories: list[Trajectory]) -> None:
    """--train.rollout_dump_dir: the trajectories a step trained on, for `--train.rollout_replay_dir`."""
    if cfg.train.rollout_dump_dir:
        Path(cfg.train.rollout_dump_dir).mkdir(parents=True, exist_ok=True)
        write_jsonl(f"{cfg.train.rollout_dump_dir}/step_{step:06d}.jsonl", trajectories)


def _on_sigterm() -> asyncio.Event:
    """Set by a SIGTERM (a preemption): the loop then saves a checkpoint after its step and exits with 143. Only a
    loop on the main thread can take the signal (`instar.rl` on a thread of its own leaves it as it is)."""
    stop = asyncio.Event()
    if threading.current_thread() is threading.main_thread():  # after ray.init, which sets a handler of its own
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    return stop


async def save_due(cfg: RLConfig, cluster: Cluster, step: int, stream: PromptStream, kl: KLController,
                   pool: Pool, now: bool = False) -> None:
    """The checkpoint due after ``step`` (every --ckpt.save_steps, the last, and ``now``), and the HF export (every
    --ckpt.hf_save_steps)."""
    out = Path(cfg.ckpt.output_dir)
    if now or (cfg.ckpt.save_steps and step % cfg.ckpt.save_steps == 0) or step == cfg.train.max_steps:
        ledger = out / "ledger.jsonl"
        extra = {"step": step, "stream": stream.state_dict(), "kl": kl.state_dict(), "pool": pool.state().to_json(),
                 "ledger_lines": len(ledger.read_text().splitlines()) if ledger.exists() else 0}
        await cluster.trainer.save(str(out / "checkpoints"), extra, cfg.ckpt.max_num)
    if cfg.ckpt.hf_save_steps and step % cfg.ckpt.hf_save_steps == 0:
        await cluster.trainer.export_hf(str(out / f"hf_step_{step}"))


async def resume(cfg: RLConfig, cluster: Cluster, stream: PromptStream, kl: KLController) -> tuple[int, PoolState]:
    """Restore the latest checkpoint when --ckpt.load_enable: weights (pushed to the engines), data
    position, ledger, KL controller, and the rollouts that were generated but not yet trained."""
    path = checkpoint.latest(str(Path(cfg.ckpt.output_dir) / "checkpoints")) if cfg.ckpt.load_enable else None
    extra = await cluster.trainer.load(path) if path else {"step": 0, "ledger_lines": 0}
    # What was written after the checkpoint (or by a run that died before its first) is redone now
    run_dir.truncate_lines(Path(cfg.ckpt.output_dir) / "ledger.jsonl", extra["ledger_lines"])
    run_dir.truncate_dumps(cfg.train.rollout_dump_dir, extra["step"])
    pool = PoolState.from_json(extra["pool"]) if path else PoolState()
    if path:
        stream.load_state_dict(extra["stream"], pending=[(g.epoch, g.prompt_index) for g in pool.pending])
        kl.load_state_dict(extra["kl"])
    if path or cfg.actor.lora_path:  # a fresh run from a trained adapter: the engines hold only the base
        await cluster.sync_weights(extra["step"], cluster.plan.resume_in_flight)
    return extra["step"], pool

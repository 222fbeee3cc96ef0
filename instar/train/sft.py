"""`instar sft`: supervised fine-tuning with the same loading, sharding, packing, checkpoint and
export path as RL; the loss is the token-mean NLL of assistant tokens over the whole batch."""

from __future__ import annotations

import os
import random
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from instar.config import ConfigError, SFTConfig, TrainConfig
from instar.contract import Sample
from instar.data.chat import load_tokenizer, read_template
from instar.data.images import Vision
from instar.data.records import Subset
from instar.data.sft import load_sft_samples
from instar.train import checkpoint
from instar.train.batch import LossInputs
from instar.train.launch import cpu_threads, reserve_port, run_ranks
from instar.train.run_dir import MetricsLogger
from instar.train.worker import TrainWorker


def sft_loss(logprobs: Tensor, entropy: Tensor, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
    """This micro-batch's share of the mean NLL over all assistant tokens of the step."""
    nll = -torch.where(x.action_mask, logprobs, 0).sum()
    return nll / x.global_num_action_tokens, {}


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    """Fine-tune ``--actor.model_name_or_path`` on ``--sft.dataset``; writes ``metrics.jsonl``,
    checkpoints and the final HF export (``hf/``) into ``--ckpt.output_dir``. Returns the last
    step's metrics. One rank runs in this process; more are spawned locally."""
    if cfg.sft.batch_size < cfg.fsdp.num_ranks:
        raise ConfigError(f"--sft.batch_size {cfg.sft.batch_size} must be >= --fsdp.num_ranks {cfg.fsdp.num_ranks}")
    read_template(cfg.sft.chat_template, cfg.sft.chat_template_kwargs, "sft")  # fails here, not in each rank
    if cfg.fsdp.num_ranks == 1:
        threads = torch.get_num_threads()
        try:
            return _sft_rank(0, 1, reserve_port(), cfg)
        finally:  # this process goes on after SFT (tests, notebooks): leave its threads as they were
            torch.set_num_threads(threads)
    return run_ranks(_sft_rank, cfg.fsdp.num_ranks, cfg)[0]


def _split(samples: list[Sample], fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    n_eval = int(round(len(samples) * fraction))
    return [samples[i] for i in order[n_eval:]], [samples[i] for i in order[:n_eval]]


def eval_loss(worker: TrainWorker, samples: list[Sample]) -> float:
    """Mean NLL per assistant token of ``samples`` (this rank's share), over all ranks."""
    logprobs = worker.compute_logprobs(samples)
    nll = sum(-(lp * torch.tensor(s.action_mask)).sum().item() for s, lp in zip(samples, logprobs))
    total, count = worker.sum_over_data([nll, sum(s.num_actions for s in samples)])
    return total / count


def _sft_rank(rank: int, world: int, port: int, cfg: SFTConfig) -> dict[str, float]:
    torch.set_num_threads(cpu_threads(world))  # nothing else computes during SFT: the ranks share every core
    tokenizer = load_tokenizer(cfg.actor.model_name_or_path, cfg.sft.chat_template, cfg.sft.chat_template_kwargs, "sft")
    samples = load_sft_samples(cfg.sft.dataset, tokenizer, cfg.sft.messages_key, cfg.sft.max_len,
                               split=cfg.sft.split, vision=Vision.from_pretrained(cfg.actor.model_name_or_path),
                               subset=Subset(cfg.sft.dataset_config, cfg.sft.dataset_revision, cfg.sft.data_files))
    train, held_out = _split(samples, cfg.sft.eval_fraction, cfg.actor.seed)
    steps_per_epoch = len(train) // cfg.sft.batch_size  # the incomplete last batch is dropped
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(train)} training conversations cannot fill one --sft.batch_size {cfg.sft.batch_size}")
    total = cfg.sft.epochs * steps_per_epoch
    schedule = TrainConfig(max_steps=total, max_tokens_per_gpu=cfg.sft.max_tokens_per_gpu)  # no other --train.* here
    worker = TrainWorker(cfg.actor, cfg.fsdp, schedule, cpu=cfg.cpu)
    worker.init(rank, world, "127.0.0.1", port)
    ckpt_dir, out = os.path.join(cfg.ckpt.output_dir, "checkpoints"), cfg.ckpt.output_dir
    path = checkpoint.latest(ckpt_dir) if cfg.ckpt.load_enable else None
    start = worker.load(path)["step"] if path else 0
    held_out = worker.share(held_out) if len(held_out) >= cfg.fsdp.data_size else []
    metrics: dict[str, float] = {}
    logger = MetricsLogger(out, cfg.log, total, start, asdict(cfg), "sft") if rank == 0 else None
    log = logger.log if logger else lambda step, metrics: None
    if held_out and start == 0:
        log(0, {"eval/loss": eval_loss(worker, held_out)})
    try:
        order: list[int] = []
        for step in range(start, total):
            epoch, k = divmod(step, steps_per_epoch)
            if k == 0 or not order:  # an epoch's order, drawn once (also when resuming mid-epoch)
                order = list(range(len(train)))
                random.Random(cfg.actor.seed + epoch).shuffle(order)
            batch = [train[i] for i in order[k * cfg.sft.batch_size:(k + 1) * cfg.sft.batch_size]]
            metrics = {"epoch": epoch, **worker.train_policy(batch, sft_loss).metrics}
            last = step + 1 == total
            if held_out and (last or (cfg.sft.eval_steps and (step + 1) % cfg.sft.eval_steps == 0)):
                metrics["eval/loss"] = eval_loss(worker, held_out)
            log(step + 1, metrics)
            if (cfg.ckpt.save_steps and (step + 1) % cfg.ckpt.save_steps == 0) or (last and cfg.ckpt.save_steps == 0):
                worker.save(ckpt_dir, {"step": step + 1}, cfg.ckpt.max_num)
            if cfg.ckpt.hf_save_steps and (step + 1) % cfg.ckpt.hf_save_steps == 0 and not last:
                worker.export_hf(os.path.join(out, "hf_steps", f"step_{step + 1}"))
        worker.export_hf(os.path.join(out, "hf"))
    finally:
        if logger:
            logger.close()
        worker.shutdown()
    return {"step": total, **metrics}


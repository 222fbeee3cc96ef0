"""One trainer rank: a plain class (no Ray) that owns the sharded policy, its optimizer and schedule,
the optional frozen reference and the optional critic, and does everything a step needs.

Every public method is collective: call it on all ranks at once, each with its own share of the samples
(``batch.shard_samples``). ``runtime/trainer_group.py`` wraps this class in Ray actors; tests drive it directly.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from instar.config import ActorConfig, CpuConfig, CriticConfig, FSDPConfig, TrainConfig
from instar.contract import Sample
from instar.train import checkpoint, lora, parallel, weight_sync
from instar.train.attention import packed_rows
from instar.train.batch import (
    ROW_MULTIPLE,
    LossInputs,
    MicroBatch,
    StepInputs,
    collate,
    identity,
    plan_micro_batches,
    right_pad,
    shard_samples,
)
from instar.train.context_parallel import SumOverChunks, chunk_rows, split_row
from instar.train.load import load_sharded
from instar.train.model import forward_logits, token_logprobs
from instar.train.moe import freeze_routers, replay_routes
from instar.train.optim import build_optimizer, build_scheduler


@dataclass
class TrainStats:
    """What a training call reports: its metrics (``actor/...``, means over the updates) and, for the KL
    controller, the measured KL to the reference on action tokens (None without a reference)."""

    metrics: dict[str, float]
    ref_kl: float | None = None


LossFn = Callable[[Tensor, Tensor, LossInputs], tuple[Tensor, dict[str, Any]]]
"""Policy loss: ``(logprobs [B,T], entropy [B,T], inputs) -> (loss, metrics)``. The loss is this
micro-batch's share of the update's loss (a sum over its tokens / ``inputs.global_num_action_tokens``, or
with the weights of --actor.loss_agg_mode); metrics are shares too: they are summed over micro-batches and ranks."""
ValueLossFn = Callable[[Tensor, LossInputs], tuple[Tensor, dict[str, Any]]]
"""Critic loss: ``(values [B,T], inputs) -> (loss, metrics)``, with the same share rule."""


class TrainWorker:
    def __init__(self, actor: ActorConfig, fsdp: FSDPConfig, train: TrainConfig,
                 critic: CriticConfig | None = None, ref_path: str | None = None, cpu: CpuConfig | None = None) -> None:
        self.fsdp, self.train, self.critic_cfg, self.ref_path = fsdp, train, critic, ref_path
        self.actor = lora.with_adapter_config(actor)  # --actor.lora_path: the adapter's own rank and targets
        self.cpu = cpu or CpuConfig()
        self.step = 0
        self.sync_group: weight_sync.SyncGroup | None = None
        self.before_micro_batch: Callable[[], None] = lambda: None  # e.g. picks the compute threads (trainer_group)
        self.threads_used: list[int] = []  # compute threads of each micro-batch since the last update's metrics

    def init(self, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        """Join the process group, load and shard the models, build optimizers."""
        parallel.init_distributed(rank, world_size, master_addr, master_port)
        self.rank, self.device = rank, parallel.device_type()
        torch.manual_seed(self.actor.seed)
        self.layout: parallel.Layout = parallel.build_layout(self.fsdp)
        self.cp_group = self.layout.mesh["cp"].get_group() if self.layout.size["cp"] > 1 else None
        a = self.actor
        self.policy = self._load(a.model_name_or_path, freeze_routers if a.freeze_moe_router else None,
                                 lora_adapters=a.lora_rank > 0)
        # prefix-tree rows need attention that reads `Segments`: ours (packed, or packed inside Ulysses)
        self.share_prefix = self.train.share_prefix and packed_rows(self.policy.config._attn_implementation)
        bf16 = "bfloat16" in (self.fsdp.mixed_precision, a.dtype)
        self.pad_rows = ROW_MULTIPLE if bf16 and self.device == "cpu" else 1
        self.optimizer = build_optimizer(self.policy, a.learning_rate, a.adam_betas, a.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, a.lr_warmup_steps, self.train.max_steps, a.lr_scheduler)
        # with LoRA the policy's own base is the reference when it is the same checkpoint: no second copy
        self.ref_is_base = a.lora_rank > 0 and self.ref_path == a.model_name_or_path
        separate_ref = self.ref_path and not self.ref_is_base
        self.ref = self._load(self.ref_path, lambda m: m.requires_grad_(False)) if separate_ref else None
        self.critic = None
        if self.critic_cfg is not None:
            self.critic = self._load(self.critic_cfg.model_name_or_path or a.model_name_or_path, value_model=True)
            self.critic_optimizer = build_optimizer(self.critic, self.critic_cfg.learning_rate, a.adam_betas,
                                                    a.weight_decay)
            self.critic_scheduler = build_scheduler(self.critic_optimizer, a.lr_warmup_steps, self.train.max_steps,
                                                    a.lr_scheduler)

    def _load(self, path: str, prepare: Callable[[nn.Module], Any] | None = None, value_model: bool = False,
              lora_adapters: bool = False) -> nn.Module:
        return load_sharded(path, self.actor, self.fsdp, self.layout, self.cpu, prepare, value_model, lora_adapters)

    # ---- forward passes -------------------------------------------------------------------------

    def _micro_batches(self, samples: list[Sample], inputs: StepInputs | None = None,
                       indices: list[int] | None = None, forward_only: Collection[int] = (),
                       ) -> Iterator[tuple[MicroBatch, bool, bool]]:
        """Packed ``(micro_batch, repeat, backward)``: the ``forward_only`` samples' (positions) first (a
        forward without gradient after a backward loses FSDP2's root gradients), then the others. Each kind
        is padded with repeats to the largest count on any rank: FSDP gathers parameters collectively.
        ``indices`` name the samples in the lists of ``inputs`` (default: their position)."""
        kinds = []
        for backward in (False, True):
            part = [k for k in range(len(samples)) if (k in forward_only) != backward]
            plan = plan_micro_batches([len(samples[k].token_ids) for k in part], self.train.max_tokens_per_gpu,
                                      [identity(samples[k]) for k in part] if self.share_prefix else None)
            kinds.append([[part[j] for j in bin_] for bin_ in plan])
        if not any(kinds):
            raise ValueError(f"trainer rank {self.rank} got no samples; give every rank at least one")
        counts = [int(c) for c in parallel.all_reduce([len(plan) for plan in kinds], op="max")]
        for plan, count, backward in zip(kinds, counts, (False, True)):
            spare = plan or kinds[0] or kinds[1]  # a rank with none of this kind repeats another pass
            for k in range(count):
                self.before_micro_batch()
                self.threads_used.append(torch.get_num_threads())
                mb = collate(samples, spare[min(k, len(spare) - 1)], inputs, self.device, indices, self.share_prefix,
                             self.pad_rows)
                yield mb, k >= len(plan), backward

    def _replay(self, model: nn.Module, mb: MicroBatch):
        if not self.train.routing_replay or model is not self.policy:
            return contextlib.nullcontext()
        if mb.routed_experts is None:
            raise ValueError("--train.routing_replay is on but some samples carry no routed_experts; "
                             "the engine must record them for every sample (or turn routing replay off)")
        routes = mb.routed_experts if self.cp_group is None else chunk_rows(mb.routed_experts, self.cp_group, -1)
        return replay_routes(model, routes)

    def _row_logprobs(self, net: nn.Module, mb: MicroBatch, temperature: float, select: Tensor,
                      with_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
        """Logprob (and entropy) of each token that ``select`` (``[B, T]`` bool) picks, as ``[B, T]`` (0
        elsewhere): the row's logits only at the positions that predict them (the head and the float32
        softmax cost those rows, not the row's), each with its own target (in a shared row one position
        predicts a different next token for each continuation). With context parallelism each cp rank
        runs its chunk of the row (`split_row`) and every cp rank gets the whole results."""
        positions, targets = mb.gather[select], mb.inputs.token_ids[select]
        if self.cp_group is None:
            logits = forward_logits(net, mb.input_ids, mb.position_ids, positions, mb.attention_kwargs,
                                    mb.images, mb.rope)
            logp, entropy = token_logprobs(logits, targets, temperature, with_entropy)
        else:  # no images here: context parallelism refuses vision-language models (`checks.check_layout`)
            c = split_row(mb.input_ids, mb.position_ids, mb.segments, self.cp_group, positions)
            logits = forward_logits(net, c.input_ids, c.position_ids, c.local, c.attention)
            logp, entropy = token_logprobs(logits, targets[c.mine], temperature, with_entropy)
            logp, entropy = (None if v is None else SumOverChunks.apply(_spread(c.mine, v), self.cp_group)
                             for v in (logp, entropy))
        return _spread(select, logp), _spread(select, entropy)

    def _row_values(self, mb: MicroBatch) -> Tensor:
        """The critic's value at each position of the row, like `_row_logprobs`."""
        if self.cp_group is None:
            return self.critic(mb.input_ids, mb.position_ids, mb.attention_kwargs)[0]
        c = split_row(mb.input_ids, mb.position_ids, mb.segments, self.cp_group)
        values = self.critic(c.input_ids, c.position_ids, c.attention)[0]
        return SumOverChunks.apply(c.spread_row(values), self.cp_group)

    @torch.no_grad()
    def compute_logprobs(self, samples: list[Sample], temperature: float = 1.0, model: str = "policy") -> list[Tensor]:
        """Per sample, a float32 tensor aligned with its token_ids: logprob of each token given the
        tokens before it (index 0 holds 0). ``model``: "policy" or "ref"."""
        base = model == "ref" and self.ref_is_base
        net = self.policy if model == "policy" or base else self.ref
        if net is None:
            raise ValueError("no reference model loaded; start the trainer with a ref_path "
                             "(--algo.kl.coef > 0 or on_policy_distill)")

        def logprobs(mb: MicroBatch) -> Tensor:
            with self._replay(net, mb), lora.adapters_off(net) if base else contextlib.nullcontext():
                return self._row_logprobs(net, mb, temperature, mb.valid, with_entropy=False)[0]
        return self._per_sample(samples, logprobs)

    @torch.no_grad()
    def compute_values(self, samples: list[Sample]) -> list[Tensor]:
        """Critic values per sample, aligned like logprobs: index t is V(tokens before t)."""
        return self._per_sample(samples, lambda mb: mb.unpack(self._row_values(mb)))

    def _per_sample(self, samples: list[Sample], rows: Callable[[MicroBatch], Tensor]) -> list[Tensor]:
        """``rows(mb)`` (``[B, T]``) of every micro-batch of ``samples``, as one tensor per sample."""
        out: dict[int, Tensor] = {}
        for mb, repeat, _ in self._micro_batches(samples):
            values = rows(mb)
            if not repeat:
                out.update(zip(mb.indices, mb.split(values)))
        return [out[i] for i in range(len(samples))]

    # ---- optimizer steps ------------------------------------------------------------------------

    def train_policy(self, samples: list[Sample], loss_fn: LossFn, inputs: StepInputs | None = None,
                     temperature: float = 1.0, updates: list[list[int]] | None = None,
                     forward_only: list[int] | None = None) -> TrainStats:
        """Optimizer updates of the policy, one per entry of ``updates`` (index lists into ``samples``;
        default: one update over all of them). ``samples`` and ``inputs`` are the whole batch, the same on
        every rank; each rank takes its work-balanced share of each update. ``forward_only``: samples whose
        loss has no gradient: forward only (metrics, old logprobs), or left out (`_run_rows`); either leaves
        the update as it was.

        "Old" logprobs (the policy before the first update, the denominator of the PPO ratio) come from
        ``inputs.old_logprobs`` when given. Otherwise the first update uses its own forward, detached
        (ratio exactly 1, no extra pass), and only samples used later get a no-grad pass first."""
        updates = updates or [list(range(len(samples)))]
        inputs = inputs or StepInputs()
        old: dict[int, Tensor] = dict(enumerate(inputs.old_logprobs or []))
        inputs = replace(inputs, old_logprobs=None)  # set per micro-batch below
        runs = [self._run_rows(update, set(forward_only or ())) for update in updates]
        later = sorted(set().union(*runs[1:]) - set(runs[0]))
        captured: dict[int, Tensor] = {}  # this rank's old logprobs, shared with the others after update 0
        if later and any(i not in old for i in later):
            mine = self._share(samples, later)
            captured.update(zip(mine, self.compute_logprobs([samples[i] for i in mine], temperature)))

        def loss_of(mb: MicroBatch) -> tuple[Tensor, dict[str, Any]]:
            # the loss reads action tokens only: logits (and their float32 softmax) at those positions
            logp, entropy = self._row_logprobs(self.policy, mb, temperature, mb.valid & mb.inputs.action_mask)
            if mb.indices[0] not in old:  # the first update: its own forward is the old policy
                mb.inputs.old_logprobs = logp.detach()
                captured.update(zip(mb.indices, mb.split(logp)))
            else:
                mb.inputs.old_logprobs = right_pad([old[i] for i in mb.indices], logp.shape[1]).to(self.device)
            return loss_fn(logp, entropy, mb.inputs)

        def after_first_update() -> None:  # later updates (and epochs) compare against the same old policy
            if len(updates) > 1:
                for part in parallel.all_gather_objects(captured):
                    old.update(part)
        return self._updates(self.policy, self.optimizer, self.scheduler, samples, inputs, updates, loss_of, "actor",
                             after_first_update, set(forward_only or ()))

    def train_critic(self, samples: list[Sample], loss_fn: ValueLossFn, inputs: StepInputs,
                     updates: list[list[int]] | None = None) -> TrainStats:
        """Critic updates (``inputs.old_values``, ``inputs.returns``), split like `train_policy`."""
        return self._updates(self.critic, self.critic_optimizer, self.critic_scheduler, samples, inputs,
                             updates or [list(range(len(samples)))],
                             lambda mb: loss_fn(mb.unpack(self._row_values(mb)), mb.inputs), "critic")

    def _run_rows(self, update: list[int], forward_only: Collection[int]) -> list[int]:
        """The rows of ``update`` that run: all, or those with a gradient under ``--train.forward_only_rows false``
        while every data-parallel rank keeps one (`shard_samples` then gives each rank a row)."""
        if self.train.forward_only_rows or not forward_only:
            return update
        trained = [i for i in update if i not in forward_only]
        return trained if len(trained) >= self.layout.data_size else update

    def _share(self, samples: list[Sample], indices: list[int], forward_only: Collection[int] = ()) -> list[int]:
        """This rank's part of ``indices``, split alike on every data-parallel rank (its tp and cp ranks take
        the same part) by work: a ``forward_only`` sample costs a third of one with a backward."""
        seqs = [identity(samples[i]) for i in indices] if self.share_prefix else None
        shards = shard_samples([len(samples[i].token_ids) for i in indices], self.layout.data_size, seqs,
                               [1 if i in forward_only else 3 for i in indices])
        return [indices[k] for k in shards[self.layout.data_rank]]

    def share(self, samples: list[Sample]) -> list[Sample]:
        """This rank's part of ``samples`` (see `_share`)."""
        return [samples[i] for i in self._share(samples, list(range(len(samples))))]

    def sum_over_data(self, values: list[float]) -> list[float]:
        """Sums over the data-parallel ranks of what each data shard computed (counted once per shard)."""
        return parallel.all_reduce([v if self.layout.lead else 0.0 for v in values])

    def _updates(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, samples: list[Sample],
                 inputs: StepInputs, updates: list[list[int]], loss_of: Callable, prefix: str,
                 after_first: Callable[[], None] | None = None, forward_only: Collection[int] = ()) -> TrainStats:
        self.threads_used.clear()
        start, clip = time.perf_counter(), self.actor.max_grad_norm if self.actor.max_grad_norm > 0 else float("inf")
        lr = optimizer.param_groups[0]["lr"]
        per_update: list[dict[str, float]] = []
        for u, update in enumerate(updates):
            global_tokens = sum(samples[i].num_actions for i in update)  # skipped rows count: the same update
            # a trajectory's seq_weights sum to 1 (its rows are all in this update): the update's trajectories
            seqs = round(sum(float(inputs.seq_weights[i].sum()) for i in update)) if inputs.seq_weights else None
            run = self._run_rows(update, forward_only)
            mine = self._share(samples, run, forward_only)
            optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            idle = {k for k, i in enumerate(mine) if i in forward_only}
            for mb, repeat, backward in self._micro_batches([samples[i] for i in mine], inputs, mine, idle):
                mb.inputs.global_num_action_tokens = torch.tensor(global_tokens, device=self.device)
                mb.inputs.global_num_seqs = seqs
                with self._replay(model, mb), torch.set_grad_enabled(backward):
                    loss, metrics = loss_of(mb)
                    # FSDP averages gradients over the ranks it shards over, but each rank's loss is already
                    # its share of the global token sum: scale so the reduced gradient is the global mean's.
                    # (cp ranks share one loss, each backpropagating it through its own chunk: `SumOverChunks`.)
                    if backward:
                        (loss * (0.0 if repeat else float(self.layout.shard_size))).backward()
                if not repeat:
                    for k, v in {"micro_batches": 1, "loss": loss, **metrics}.items():
                        sums[k] = sums.get(k, 0.0) + float(v.detach() if isinstance(v, Tensor) else v)
            if isinstance(model, FSDPModule):  # after a forward without backward the root keeps its gathered
                model.reshard()  # weights, which the step would leave stale for the next forward
            trained = [p for p in model.parameters() if p.requires_grad]
            if all(p.grad is None for p in trained):  # every pass was forward only: the gradient is zero,
                for p in trained:  # and the optimizer steps on it as it would have (momentum, weight decay)
                    p.grad = torch.zeros_like(p)
            grad_norm = parallel.clip_grad_norm(trained, clip)  # global: every rank skips alike
            if math.isfinite(grad_norm):  # a NaN or inf gradient would make every weight NaN: skip the update
                optimizer.step()
            names = sorted(sums)
            totals = self.sum_over_data([sums.get(k, 0.0) for k in names])
            if len(run) < len(update):  # shares of every action token: as means over the trained rows' tokens
                scale = global_tokens / sum(samples[i].num_actions for i in run)
                totals = [v if k == "micro_batches" else v * scale for k, v in zip(names, totals)]
            per_update.append({**dict(zip(names, totals)), "grad_norm": float(grad_norm)})
            if u == 0 and after_first is not None:
                after_first()
        scheduler.step()  # the schedule counts rollout batches (RL steps), not mini-batch updates
        if model is self.policy:
            self.step += 1
        mean = {k: sum(m.get(k, 0.0) for m in per_update) / len(per_update) for k in per_update[0]}
        skipped = sum(not math.isfinite(m["grad_norm"]) for m in per_update)
        mean |= {"lr": lr, "updates": float(len(updates)), "samples": float(len(samples)),
                 "action_tokens": float(sum(s.num_actions for s in samples)), "skipped_nonfinite": float(skipped),
                 "step_time": time.perf_counter() - start, "threads": sum(self.threads_used) / len(self.threads_used)}
        return TrainStats({f"{prefix}/{k}": v for k, v in mean.items()}, ref_kl=mean.get("ref_kl"))

    # ---- weight sync, checkpoints, export --------------------------------------------------------

    def open_weight_sync(self, master_addr: str, master_port: int, world_size: int,
                         transport: weight_sync.Transport = "gloo") -> None:
        """Trainer rank 0 joins (and hosts) the weight-sync group as its rank 0; other ranks do nothing."""
        if self.rank == 0:
            if self.sync_group is not None:  # a new group because an engine restarted: the old one is done
                with contextlib.suppress(Exception):  # its last broadcast may have failed with that engine
                    self.sync_group.wait_sent()
            self.sync_group = weight_sync.open_sync_group(master_addr, master_port, 0, world_size, transport)

    def send_weights(self, bucket_mb: float = 256.0, background: bool = False) -> dict[str, float]:
        """Broadcast the policy's full weights (HF names) to the engines; collective over trainer ranks.
        Pausing the engines and bumping their version is the caller's side of the protocol.
        ``background``: see `weight_sync.send_weights` (the next call here may start meanwhile)."""
        # under LoRA only the adapted layers change: they go merged, and the engines keep the rest
        named = lora.merged_weights(self.policy) if self.actor.lora_rank else self.policy.named_parameters()
        try:
            return weight_sync.send_weights(named, self.sync_group, bucket_mb, background=background)
        except weight_sync.SyncAbandoned:  # an engine died in it: the driver syncs again, in a new group
            return {"weight_sync/abandoned": 1.0}

    def save(self, root: str, extra: dict[str, Any] | None = None, max_num: int = 0) -> str:
        meta = {"scheduler": self.scheduler.state_dict(), "policy_step": self.step, "extra": extra or {}}
        if self.critic is not None:
            meta["critic_scheduler"] = self.critic_scheduler.state_dict()
        return checkpoint.save(root, self.step, self._stateful(), meta, max_num)

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint; returns the ``extra`` dict given to ``save``."""
        meta = checkpoint.load(path, self._stateful())
        self.scheduler.load_state_dict(meta["scheduler"])
        if self.critic is not None:
            self.critic_scheduler.load_state_dict(meta["critic_scheduler"])
        self.step = meta["policy_step"]
        return meta["extra"]

    def _stateful(self) -> checkpoint.Stateful:
        models = {"policy": (self.policy, self.optimizer)}
        if self.critic is not None:
            models["critic"] = (self.critic, self.critic_optimizer)
        return models

    def export_hf(self, out_dir: str) -> str:
        """Write the policy as an HF checkpoint (`checkpoint.export_hf`). Collective; rank 0 writes."""
        return checkpoint.export_hf(self.policy, out_dir, self.actor.model_name_or_path, self.actor.lora_merged_export)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spread(mask: Tensor, values: Tensor | None) -> Tensor | None:
    """``values`` at the places ``mask`` picks, in a tensor of zeros of ``mask``'s shape."""
    return None if values is None else values.new_zeros(mask.shape).masked_scatter(mask, values)

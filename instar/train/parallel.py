"""How the trainer is sharded: the process group, the device mesh and its `Layout` (built once), and
`parallelize`, the one entry that applies tensor, expert and context parallelism, activation
checkpointing, torch.compile and FSDP2 to any model, in that order. The model code never sees any of it.

The mesh is (rep, dp, cp, ep, tp), row-major over the ranks: tp innermost (the ranks that exchange the
most), the replicas of hybrid sharding outermost (across nodes, when ranks fill nodes in order); rep x dp x ep
ranks see different samples, cp and tp ranks of one data shard the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from instar.checks import check_layout
from instar.config import FSDPConfig
from instar.train.context_parallel import apply_context_parallel
from instar.train.expert_parallel import apply_expert_parallel, experts_modules
from instar.train.launch import open_store
from instar.train.model import DTYPES, decoder_layers, enable_activation_checkpointing
from instar.train.tensor_parallel import apply_tensor_parallel


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join the trainer's process group: gloo on CPU; on GPU NCCL for tensors plus gloo for the
    CPU-side objects (metadata, RNG states) that collectives sometimes carry. ``master_port``: from
    `reserve_port`."""
    if dist.is_initialized():
        return
    backend = "gloo"
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        backend = "cpu:gloo,cuda:nccl"
    timeout = timedelta(minutes=30)
    dist.init_process_group(backend, store=open_store(master_addr, master_port, world_size, timeout), rank=rank,
                            world_size=world_size, timeout=timeout)


@dataclass
class Layout:
    """This rank's place in the mesh, and what the worker needs from it."""

    mesh: DeviceMesh  # ("rep", "dp", "cp", "ep", "tp")

    def __post_init__(self) -> None:
        # by dimension name, read once: the worker asks for these in every micro-batch, and slicing a mesh is not free
        names = self.mesh.mesh_dim_names
        self.size: dict[str, int] = dict(zip(names, self.mesh.shape))
        self.rank: dict[str, int] = dict(zip(names, self.mesh.get_coordinate()))
        self.data_size = self.size["rep"] * self.size["dp"] * self.size["ep"]  # ranks that see different samples
        self.data_rank = (self.rank["rep"] * self.size["dp"] + self.rank["dp"]) * self.size["ep"] + self.rank["ep"]
        self.shard_size = self.data_size * self.size["cp"]  # the ranks gradients average over (FSDP's, replicas too)
        # the first rank of its cp x tp group: counts what the group computed together once
        self.lead = self.rank["cp"] == 0 and self.rank["tp"] == 0

    def fsdp_mesh(self, dims: tuple[str, ...] = ("dp", "cp", "ep")) -> DeviceMesh:
        """``dims`` flattened into the 1-D mesh FSDP shards over; under hybrid sharding (replicas) the 2-D
        (rep, shard) mesh FSDP2 replicates over and shards within."""
        if len([d for d in dims if self.size[d] > 1]) <= 1:  # nothing to flatten: the one dimension with ranks
            shard = next((d for d in dims if self.size[d] > 1), dims[0])
        else:
            shard = self.mesh[dims]._flatten("_".join(dims)).mesh_dim_names[0]
        return self.mesh[("rep", shard) if self.size["rep"] > 1 else shard]


def build_layout(fsdp: FSDPConfig) -> Layout:
    """The mesh over all trainer ranks; the one place parallel dimensions are named."""
    world = dist.get_world_size()
    if world != fsdp.num_ranks:
        raise ValueError(f"--fsdp.num_ranks is {fsdp.num_ranks} but {world} trainer processes joined; "
                         "start exactly --fsdp.num_ranks ranks")
    check_layout(fsdp)
    # cp before ep: to reduce an expert gradient's norm DTensor flattens its (cp, ep) dimensions, which must be in
    # mesh order (EP x CP failed in clip_grad_norm the other way round)
    rep = fsdp.replicate_size
    shape = (rep, fsdp.data_size // fsdp.ep_size // rep, fsdp.cp_size, fsdp.ep_size, fsdp.tp_size)
    return Layout(init_device_mesh(device_type(), shape, mesh_dim_names=("rep", "dp", "cp", "ep", "tp")))


def parallelize(model: nn.Module, layout: Layout, fsdp: FSDPConfig) -> nn.Module:
    """TP, EP, CP, activation checkpointing, compile, then FSDP2, in place. Parameters become DTensors with
    their HF names unchanged (plain tensors on a lone rank); `weight_sync` and `checkpoint` gather or
    reshard them by name."""
    check_layout(fsdp, model.config)
    if fsdp.offload == "none" and not any(p.is_meta for p in model.parameters()):  # meta: materialised later
        model.to(device_type())
    if layout.size["tp"] > 1:
        apply_tensor_parallel(model, layout.mesh["tp"])
    expert_mesh = None
    if layout.size["ep"] > 1:
        apply_expert_parallel(model, layout.mesh["ep"])
        expert_mesh = layout.fsdp_mesh(("dp", "cp"))  # the data ranks that hold the same experts
    if layout.size["cp"] > 1:
        apply_context_parallel(model, layout.size["cp"], fsdp.attn_implementation)
    if fsdp.activation_checkpointing:
        enable_activation_checkpointing(model)
    if fsdp.compile:
        compile_layers(model)
    if layout.mesh.size() == 1 and fsdp.offload == "none" and fsdp.mixed_precision == "float32":
        return model  # FSDP on one rank would only add hooks around every layer: ~5% of an update on CPU
    return apply_fsdp(model, layout.fsdp_mesh(), fsdp, expert_mesh)


def compile_layers(model: nn.Module) -> None:
    """--fsdp.compile: each dense decoder layer's forward through torch.compile with dynamic shapes, so one graph
    serves every micro-batch. Packed attention stays eager (registered as such: it plans per row layout in Python,
    which a graph would recompile for); MoE layers and vision blocks stay eager (data-dependent routing, per-image
    Python). Hooks (FSDP2, the trainer's thread picking) run around the compiled forward."""
    for layer in decoder_layers(model):
        if hasattr(layer, "self_attn") and not experts_modules(layer):
            layer.forward = _with_grad_compiled(layer.forward)


def _with_grad_compiled(eager: Callable[..., Any]) -> Callable[..., Any]:
    """Compiled when gradients are on; forwards without (logprob passes) run eager: one graph, not one per grad
    mode. Dynamo guards on its global state, the thread count included: a rank that lends cores between layers
    would recompile (~1.5 s each) for every new count. The rest of that state (grad mode aside: hence eager
    without gradients, autocast, deterministic algorithms, default dtype) is fixed for a run, so that guard
    is dropped."""
    compiled = torch.compile(eager, dynamic=True, options={"guard_filter_fn": lambda entries: [
        e.guard_type != "GLOBAL_STATE" for e in entries]})

    def forward(*args: Any, **kwargs: Any) -> Any:
        return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)
    forward.compiled = compiled
    return forward


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, fsdp: FSDPConfig, expert_mesh: DeviceMesh | None = None,
               ) -> nn.Module:
    """FSDP2 in place: ``fully_shard`` each decoder layer, then the root (embeddings, final norm,
    head). Parameters become DTensors sharded on dim 0 (of what TP left) with their HF names unchanged.
    With ``expert_mesh`` (expert parallelism) each layer's experts are sharded over that mesh first."""
    # Gradients always reduce in float32; bf16 only changes the compute dtype of forward/backward.
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[fsdp.mixed_precision], reduce_dtype=torch.float32)
    # CPU offload keeps sharded params, grads and optimizer state in host memory and steps there;
    # pinned memory needs an accelerator, so on CPU the policy only exercises the same code path.
    offload = CPUOffloadPolicy(pin_memory=device_type() == "cuda") if fsdp.offload == "optimizer" else OffloadPolicy()
    for experts in experts_modules(model) if expert_mesh is not None else []:
        fully_shard(experts, mesh=expert_mesh, mp_policy=mp, offload_policy=offload)
        # An expert's gradient already sums the losses of its ep group (the all-to-all's backward);
        # every loss is scaled by mesh.size() (dp x ep x cp), so divide by that, not by expert_mesh's
        # dp x cp. Gloo has no pre-multiplied sum: sum, then divide (not where the experts shard over one rank,
        # HSDP's replicas aside: torch 2.13 would then divide twice).
        experts.set_gradient_divide_factor(float(mesh.size()))
        experts.set_force_sum_reduction_for_comms(expert_mesh.shape[-1] > 1)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """The global gradient norm, and gradients scaled to at most ``max_norm``. Unlike torch's own
    this takes gradients on different meshes (FSDP-only and FSDP x TP parameters): one reduction
    per mesh, then the sum."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for grad in [p.grad for p in params if p.grad is not None]:
        by_mesh.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    norms = [torch.nn.utils.get_total_norm(grads) for grads in by_mesh.values()]
    total = sum(float(n.full_tensor() if hasattr(n, "full_tensor") else n) ** 2 for n in norms) ** 0.5
    if total > max_norm:
        for grads in by_mesh.values():
            torch._foreach_mul_(grads, max_norm / (total + 1e-6))
    return total


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Reduce a few floats over all trainer ranks (token counts, metric sums, micro-batch counts);
    CPU tensors travel over gloo on GPU machines too. Ranks that computed the same thing (one cp x tp
    group) contribute once: see `Layout.lead`."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.cpu().tolist()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable, small: e.g. a few per-sample tensors), in rank order."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

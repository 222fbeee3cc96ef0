"""How the trainer is sharded: the process group and device mesh (built once) and one function that
applies FSDP2 to any model. The model code never sees any of it; TP/EP would be one more function.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from instar.config import FSDPConfig
from instar.train.model import DTYPES, decoder_layers, enable_activation_checkpointing


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join the trainer's process group: gloo on CPU; on GPU NCCL for tensors plus gloo for the
    CPU-side objects (metadata, RNG states) that collectives sometimes carry."""
    if dist.is_initialized():
        return
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=30))


def build_mesh(fsdp: FSDPConfig) -> DeviceMesh:
    """The 1-D data-parallel mesh over all trainer ranks; the one place parallel dimensions are named."""
    world = dist.get_world_size()
    if world != fsdp.num_ranks:
        raise ValueError(f"--fsdp.num_ranks is {fsdp.num_ranks} but {world} trainer processes joined; "
                         "start exactly --fsdp.num_ranks ranks")
    return init_device_mesh(device_type(), (world,), mesh_dim_names=("dp",))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, fsdp: FSDPConfig) -> nn.Module:
    """FSDP2 in place: ``fully_shard`` each decoder layer, then the root (embeddings, final norm,
    head). Parameters become DTensors sharded on dim 0 with their HF names unchanged."""
    if fsdp.activation_checkpointing:
        enable_activation_checkpointing(model)
    # Gradients always reduce in float32; bf16 only changes the compute dtype of forward/backward.
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[fsdp.mixed_precision], reduce_dtype=torch.float32)
    # CPU offload keeps sharded params, grads and optimizer state in host memory and steps there;
    # pinned memory needs an accelerator, so on CPU the policy only exercises the same code path.
    offload = CPUOffloadPolicy(pin_memory=device_type() == "cuda") if fsdp.offload == "optimizer" else OffloadPolicy()
    if fsdp.offload == "none":
        model.to(device_type())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Reduce a few floats over all trainer ranks (token counts, metric sums, micro-batch counts);
    CPU tensors travel over gloo on GPU machines too."""
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

"""LoRA (``--actor.lora_rank`` > 0): PEFT's adapter layers in the policy, built on the meta device before
the model is sharded, so FSDP2 shards adapters and base alike and no rank ever holds the whole model.

Only the adapters train and sit in the optimizer (float32, whatever the base's dtype). Everything that
leaves the trainer is a plain model again: the engines receive merged weights (base + scale * B A) under
the HF names, the reference is the same model with its adapters turned off, and an export is a PEFT
adapter folder (or the merged model).
"""

from __future__ import annotations

import copy
import json
import math
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from instar.config import ActorConfig
from instar.train.weight_sync import gathered

ADAPTER = "default"  # PEFT's name for a model's one adapter; it appears in parameter names


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A parameter's name in the HF checkpoint and the engines: PEFT moves a targeted layer's own
    weight under ``base_layer``."""
    return name.replace(".base_layer.", ".")


def apply_lora(model: nn.Module, actor: ActorConfig) -> None:
    """Put LoRA layers into ``model`` (on the meta device: `init_adapter` gives them values once the model
    is sharded) and freeze everything else."""
    from peft import LoraConfig, inject_adapter_in_model
    targets = actor.lora_target_modules
    if isinstance(targets, str) and targets != "all-linear":  # one module name
        targets = [targets]
    config = LoraConfig(r=actor.lora_rank, lora_alpha=actor.lora_alpha, lora_dropout=actor.lora_dropout,
                        target_modules=targets, bias="none")
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except ValueError:
        linear = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"--actor.lora_target_modules {targets} matches no layer of the model; its linear "
                         f"layers are named {', '.join(linear)} (or give all-linear)") from None
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    for _, module in _adapted(model):
        for part in (module.lora_A[ADAPTER], module.lora_B[ADAPTER]):
            part.to(dtype=torch.float32)  # adapters and their optimizer state train in float32
    model.instar_lora = config


def with_adapter_config(actor: ActorConfig) -> ActorConfig:
    """``actor`` with --actor.lora_path's rank, alpha, dropout and target modules, as the adapter was trained."""
    if not actor.lora_path:
        return actor
    with open(os.path.join(actor.lora_path, "adapter_config.json")) as f:
        saved = json.load(f)
    return replace(actor, lora_rank=saved["r"], lora_alpha=saved["lora_alpha"],
                   lora_dropout=saved.get("lora_dropout", 0.0), lora_target_modules=saved["target_modules"])


def initial_adapters(actor: ActorConfig) -> Callable[[str, torch.Size], Tensor]:
    """The whole initial value of each adapter parameter, by name and shape: `init_adapter`'s, or
    --actor.lora_path's, checked to fit."""
    if not actor.lora_path:
        return lambda name, shape: init_adapter(name, shape, actor.seed)
    saved = load_file(os.path.join(actor.lora_path, "adapter_model.safetensors"))

    def read(name: str, shape: torch.Size) -> Tensor:
        key = "base_model.model." + name.replace(f".{ADAPTER}.", ".")
        if key not in saved or saved[key].shape != shape:
            found = tuple(saved[key].shape) if key in saved else "nothing"
            raise ValueError(f"--actor.lora_path {actor.lora_path} does not fit the model: {name} is {tuple(shape)}, "
                             f"the adapter has {found} under {key}; give an adapter trained on this model")
        return saved[key].float()
    return read


def init_adapter(name: str, full_shape: torch.Size, seed: int) -> Tensor:
    """The initial value of adapter parameter ``name``, as PEFT initialises it (A: nn.Linear's default
    uniform, B: zeros, so the model starts as its base), drawn from ``seed`` and the name alone: every
    layout of ranks starts from the same adapters."""
    if ".lora_B." in name:
        return torch.zeros(full_shape)
    generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    bound = 1 / math.sqrt(full_shape[1])  # kaiming_uniform_(a=sqrt(5)) on [rank, in_features]
    return torch.empty(full_shape).uniform_(-bound, bound, generator=generator)


def _adapted(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of every layer with an adapter."""
    from peft.tuners.lora import LoraLayer
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A)


def _merge(base: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    return (base.float() + scale * (b.float() @ a.float())).to(base.dtype)


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """``model`` as its base: the reference policy without a second copy. Sets PEFT's own switch
    directly: `enable_adapters` would also flip requires_grad on parameters FSDP2 already manages."""
    layers = [m for _, m in _adapted(model)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def merged_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(HF name, base + scale * B A) of every targeted layer's weight, whole: what an engine that holds
    the base needs to sample the current policy (nothing else changes in training). Collective: each
    sharded piece is gathered on every rank."""
    for prefix, module in _adapted(model):
        parts = (module.base_layer.weight, module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight)
        yield f"{prefix}.weight", _merge(*(gathered(t) for t in parts), module.scaling[ADAPTER])


def merged_state(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """A whole-model state dict of the LoRA ``model`` as the plain HF model's, adapters merged (a model without
    adapters: its own state)."""
    out = {base_name(k): v for k, v in state.items() if not is_adapter(k)}
    for prefix, module in _adapted(model):
        a, b = (state[f"{prefix}.lora_{x}.{ADAPTER}.weight"] for x in "AB")
        out[f"{prefix}.weight"] = _merge(out[f"{prefix}.weight"], a, b, module.scaling[ADAPTER])
    return out


def save_adapter(state: dict[str, Tensor], out_dir: str, base_model: str, model: nn.Module) -> None:
    """Write an adapter folder that ``peft.PeftModel.from_pretrained(base, out_dir)`` loads: the adapter
    tensors of the whole-model ``state`` under PEFT's saved names, and the LoRA config."""
    config = copy.copy(model.instar_lora)
    config.base_model_name_or_path = os.path.abspath(base_model)
    config.target_modules = sorted({name.rpartition(".")[2] for name, _ in _adapted(model)})  # all-linear resolved
    tensors = {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v.contiguous()
               for k, v in state.items() if is_adapter(k)}
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)

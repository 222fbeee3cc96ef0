"""Build a model at real size without any rank ever holding all of it: construct it on the meta
device (no memory, no random init), let the caller shard it (FSDP2, TP, EP: any layout of DTensors),
then give each rank storage for its shards only and fill them from the checkpoint's safetensors
files, reading only the slices that rank holds.

    model = meta_model(path, dtype, attn)          # or ValueModel(meta_model(path, dtype, attn, causal_lm=False))
    parallelize(model, ...)                       # on meta parameters
    stats = materialize(model, path, device)      # this rank's slices; stats.bytes counts them
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from instar.checks import check_lora
from instar.config import ActorConfig, CpuConfig, FSDPConfig
from instar.train import lora
from instar.train.attention import registered
from instar.train.model import DTYPES, ValueModel, auto_model, load_model
from instar.train.parallel import Layout, device_type, parallelize

Index = tuple[slice | torch.Tensor, ...]
"""Per dim of a tensor, the global positions a rank holds: a range, or (strided layouts) a list."""


def meta_model(path: str, dtype: str = "float32", attn: str = "auto", causal_lm: bool = True,
               accelerated: bool = False) -> nn.Module:
    """The HF model of checkpoint ``path`` (a causal LM, or with ``causal_lm=False`` the bare decoder
    trunk the critic wraps) with every parameter and buffer on the meta device, in train mode: what
    `instar.train.model.load_model` returns, before any weights exist. ``attn``, ``accelerated``: `attention_for`."""
    from transformers import AutoConfig, GenerationConfig
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a local checkpoint directory; per-rank loading reads its safetensors "
                         "files: download the model first (hf download <repo> --local-dir <dir>)")
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        raise ValueError(f"{path} is a LoRA adapter folder, not a model; export the run with "
                         "--actor.lora_merged_export true to train on from it")
    config = AutoConfig.from_pretrained(path)
    auto, impl = auto_model(path, attn, causal_lm, accelerated)
    with torch.device("meta"):
        model = auto.from_config(config, dtype=DTYPES[dtype], attn_implementation=impl)
    if causal_lm and os.path.exists(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)  # an HF export writes it back
    model.config.use_cache = False  # training never decodes; a KV cache would only cost memory
    return model.train()


@dataclass
class ReadStats:
    """What `materialize` read from the checkpoint on this rank."""

    bytes: int = 0
    """Bytes of tensor data read (this rank's slices, in the checkpoint's dtype)."""


def materialize(model: nn.Module, path: str, device: str | torch.device = "cpu",
                buffer_device: str | torch.device | None = None,
                adapters: Callable[[str, torch.Size], torch.Tensor] | None = None) -> ReadStats:
    """Give every meta parameter and buffer of ``model`` (sharded or not) storage for what this rank
    holds, parameters on ``device`` and buffers on ``buffer_device`` (default: ``device``; with FSDP's
    CPU offload, parameters on "cpu" and buffers where the forward runs), and fill it: parameters and
    persistent buffers of the HF model inside ``model`` from the safetensors files of checkpoint
    ``path``, this rank's slice of each; non-persistent buffers (rotary frequencies) the way
    transformers computes them; LoRA adapters from ``adapters`` (`lora.initial_adapters`). Anything
    built off the meta device (the critic's value head) keeps its values. Communicates nothing."""
    from transformers import PreTrainedModel
    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is None:
        raise ValueError(f"{type(model).__name__} holds no transformers PreTrainedModel; build it with meta_model")
    inside = {id(t) for t in [*hf.parameters(), *hf.buffers()]}
    outside = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta and id(t) not in inside]
    if outside:
        raise ValueError(f"{outside[:3]} are on the meta device but not part of the HF model, so no checkpoint "
                         "holds them; build them with real storage (outside torch.device('meta'))")
    shared: dict[int, list[str]] = defaultdict(list)  # tied weights: one parameter under several names
    for name, p in model.named_parameters(remove_duplicate=False):
        shared[id(p)].append(name)
    buffer_device = device if buffer_device is None else buffer_device
    model._apply(lambda t: t if not t.is_meta else
                 torch.empty_like(t, device=device if isinstance(t, nn.Parameter) else buffer_device))
    for first, *others in shared.values():  # a plain tensor leaves meta as a new Parameter per module: re-tie
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(first))
    for module in hf.modules():  # transformers' own loader re-runs the same init after its meta construction
        if any(n in module._non_persistent_buffers_set for n, _ in module.named_buffers(recurse=False)):
            hf._init_weights(module)
    sources = checkpoint_sources(hf, path)
    stats = ReadStats()
    done: set[int] = set()
    with torch.no_grad():
        for name, tensor in hf.state_dict(keep_vars=True).items():
            local, index = local_index(tensor)
            if lora.is_adapter(name):
                local.copy_(_select(adapters(name, tensor.shape), index))
                continue
            name = lora.base_name(name)
            if id(tensor) in done or (name not in sources and name in hf.all_tied_weights_keys):
                continue  # a tied weight: loaded under its partner's name (the same tensor)
            if name not in sources:
                raise ValueError(f"{name} is not in the checkpoint at {path}; check that its safetensors "
                                 "files match its config.json")
            data = sources[name].read(index, stats)
            if data.shape != local.shape:
                raise ValueError(f"{name}: the checkpoint gives {tuple(data.shape)} for this rank's slice "
                                 f"{tuple(local.shape)}; check that the checkpoint matches its config.json")
            local.copy_(data)
            done.add(id(tensor))
    return stats


def local_index(tensor: torch.Tensor) -> tuple[torch.Tensor, Index]:
    """This rank's local tensor and, per dim, the global positions it holds. For a DTensor they come
    from DTensor's own split (``Shard``, ``Replicate``, FSDP-over-TP ``_StridedShard``, any mesh) of
    a position vector, without communication; a plain tensor is whole."""
    if not isinstance(tensor, DTensor):
        return tensor.data, tuple(slice(0, n) for n in tensor.shape)
    index: list[slice | torch.Tensor] = []
    for d, n in enumerate(tensor.shape):
        split = [_on_dim0(p, d) for p in tensor.placements]
        if all(isinstance(p, Replicate) for p in split):
            index.append(slice(0, n))
            continue
        pos = distribute_tensor(torch.arange(n), tensor.device_mesh, split, src_data_rank=None).to_local().cpu()
        start = int(pos[0]) if pos.numel() else 0
        contiguous = torch.equal(pos, torch.arange(start, start + pos.numel()))
        index.append(slice(start, start + pos.numel()) if contiguous else pos)
    return tensor.to_local(), tuple(index)


def _select(full: torch.Tensor, index: Index) -> torch.Tensor:
    """The positions ``index`` of a whole tensor."""
    for d, i in enumerate(index):
        full = full.index_select(d, i) if torch.is_tensor(i) else full[(slice(None),) * d + (i,)]
    return full


def _on_dim0(p: Any, d: int) -> Any:
    """Placement ``p`` of a tensor, as it acts on the position vector of the tensor's dim ``d``."""
    if isinstance(p, _StridedShard):
        return _StridedShard(0, split_factor=p.split_factor) if p.dim == d else Replicate()
    if isinstance(p, Shard):
        return Shard(0) if p.dim == d else Replicate()
    if isinstance(p, Replicate):
        return p
    raise ValueError(f"cannot read a checkpoint slice for placement {p}: a Partial tensor has no slice of its "
                     "own; materialize before making any tensor Partial")


# ---- the checkpoint side ------------------------------------------------------------------------

@dataclass
class Source:
    """How one model tensor is made of checkpoint tensors: ``groups`` concatenated along ``cat_dim``
    (None: a single group), each group one checkpoint tensor or, when ``stacked``, a list of them
    stacked on a new dim 0 (MoE experts). This is transformers' renaming plus its MergeModulelist /
    Concatenate conversions (fused experts), read slice by slice."""

    files: dict[str, str]
    """Checkpoint key -> its safetensors file."""
    groups: list[list[str]]
    stacked: bool = False
    cat_dim: int | None = None

    def read(self, index: Index, stats: ReadStats) -> torch.Tensor:
        """The positions ``index`` of the model tensor, reading no more than their bounding box (just
        them, for ranges) from the files."""
        box = tuple(slice(int(i.min()), int(i.max()) + 1) if torch.is_tensor(i) else i for i in index)
        if any(s.stop <= s.start for s in box):
            return torch.empty([s.stop - s.start for s in box])
        with _Reader(self.files, stats) as reader:
            if self.cat_dim is None:
                data = self._group(reader, self.groups[0], box)
            else:
                d, parts, start = self.cat_dim, [], 0
                for keys in self.groups:
                    # stacked: dim 0 counts the stacked tensors, and their own dims are shifted by one
                    width = len(keys) if self.stacked and d == 0 else reader.shape(keys[0])[d - int(self.stacked)]
                    lo, hi = max(box[d].start, start), min(box[d].stop, start + width)
                    if lo < hi:
                        part = box[:d] + (slice(lo - start, hi - start),) + box[d + 1:]
                        parts.append(self._group(reader, keys, part))
                    start += width
                data = torch.cat(parts, dim=d)
        # the box is read: strided positions are picked within it (ranges are the whole box)
        return _select(data, tuple(i - b.start if torch.is_tensor(i) else slice(None) for i, b in zip(index, box)))

    def _group(self, reader: _Reader, keys: list[str], box: tuple[slice, ...]) -> torch.Tensor:
        if self.stacked:
            return torch.stack([reader.read(k, box[1:]) for k in keys[box[0]]])
        return reader.read(keys[0], box)


class _Reader(ExitStack):
    """Slices of checkpoint tensors, counted. Files open for one model tensor at a time: closing
    their memory maps keeps the pages read out of the rank's resident memory."""

    def __init__(self, files: dict[str, str], stats: ReadStats) -> None:
        super().__init__()
        self.files, self.stats, self.handles = files, stats, {}

    def _open(self, key: str) -> Any:
        file = self.files[key]
        if file not in self.handles:
            self.handles[file] = self.enter_context(safe_open(file, framework="pt"))
        return self.handles[file]

    def shape(self, key: str) -> list[int]:
        return self._open(key).get_slice(key).get_shape()

    def read(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        f = self._open(key)
        piece = f.get_slice(key)[box] if box else f.get_tensor(key)
        self.stats.bytes += piece.numel() * piece.element_size()
        return piece


def checkpoint_files(path: str) -> dict[str, str]:
    """Checkpoint key -> safetensors file, from the index if there is one."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not names:
        raise ValueError(f"no safetensors files in {path}; meta-device loading reads safetensors checkpoints "
                         "only (re-save the model with save_pretrained)")
    out: dict[str, str] = {}
    for name in names:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), os.path.join(path, name)))
    return out


def checkpoint_sources(hf: nn.Module, path: str) -> dict[str, Source]:
    """Model tensor name -> its `Source`, found by transformers' own key renaming (base-model
    prefixes, legacy names, MoE expert fusion), so the names agree with ``from_pretrained``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )
    files = checkpoint_files(path)
    mapping = get_model_conversion_mapping(hf)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    model_keys = {lora.base_name(k): v for k, v in hf.state_dict(keep_vars=True).items() if not lora.is_adapter(k)}
    by_target: dict[str, dict[str | None, list[str]]] = defaultdict(lambda: defaultdict(list))
    for key in sorted(files, key=dot_natural_key):  # experts in numeric order, as transformers stacks them
        name, pattern = rename_source_key(key, renamings, converters, hf.base_model_prefix, model_keys)
        if name not in model_keys and key in model_keys:
            name, pattern = key, None
        if name in model_keys:
            by_target[name][pattern].append(key)
    sources: dict[str, Source] = {}
    for name, by_pattern in by_target.items():
        if None in by_pattern:
            sources[name] = Source(files, [by_pattern[None][:1]])
            continue
        conv = next(c for c in converters if next(iter(by_pattern)) in c.source_patterns)
        merged = [op for op in conv.operations if isinstance(op, MergeModulelist) and op.dim == 0]
        cats = [op.dim for op in conv.operations if isinstance(op, Concatenate)]
        if len(conv.operations) != len(merged) + len(cats) or len(merged) > 1 or len(cats) > 1:
            raise ValueError(f"{name} is made from the checkpoint by {conv.operations}; per-rank loading reads "
                             "renamed tensors and fused experts (MergeModulelist, Concatenate) only: load this "
                             "model whole with instar.train.model.load_model")
        groups = [by_pattern[p] for p in conv.source_patterns if p in by_pattern]
        sources[name] = Source(files, groups, bool(merged), cats[0] if cats else None)
    return sources


def load_sharded(path: str, actor: ActorConfig, fsdp: FSDPConfig, layout: Layout, cpu: CpuConfig,
                 prepare: Callable[[nn.Module], Any] | None = None, value_model: bool = False,
                 lora_adapters: bool = False) -> nn.Module:
    """A trainer rank's model (``value_model``: the critic; ``lora_adapters``: the policy with --actor.lora_*
    adapters) of checkpoint ``path``: built on the meta device, ``prepare``d, sharded (`parallelize`), prepared
    by its registered attention (`train.attention.Registered`, the CPU accelerator's with ``cpu``), then filled
    with only this rank's part of the checkpoint: no rank ever holds the whole model. NVIDIA AutoModel loads
    whole first."""
    if actor.model_backend != "hf" and not value_model:
        model = load_model(path, actor.dtype, actor.model_backend, fsdp.attn_implementation)
    else:
        dtype = actor.lora_base_dtype or actor.dtype if lora_adapters else actor.dtype
        model = meta_model(path, dtype, fsdp.attn_implementation, not value_model, cpu.enable)
        model = ValueModel(model) if value_model else model
    if prepare is not None:
        prepare(model)
    if lora_adapters:
        check_lora(actor, fsdp)  # instar sft comes here without instar rl's start-up checks
        lora.apply_lora(model, actor)
    attention = registered(model.config._attn_implementation)  # before context parallelism wraps it
    parallelize(model, layout, fsdp)
    if attention is not None and attention.prepare is not None:
        attention.prepare(model, cpu)
    if any(p.is_meta for p in model.parameters()):  # FSDP's CPU offload keeps parameters on the host
        materialize(model, path, "cpu" if fsdp.offload == "optimizer" else device_type(), device_type(),
                    lora.initial_adapters(actor) if lora_adapters else None)
    return model

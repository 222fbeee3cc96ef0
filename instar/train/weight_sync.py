"""Weight sync: trainer rank 0 broadcasts full parameters, bucket by bucket, to every engine host
over a dedicated process group (gloo on CPU, NCCL on GPU), never through Ray's object store.

The group is rank 0 = the trainer's rank 0, ranks 1..E = engine hosts, built directly from a
``TCPStore`` so it is independent of the trainer's own process group. Each bucket travels as a
header (its byte length), a pickled table (name, dtype, shape, offset) and one flat byte buffer;
a zero header ends the stream. The receiver is a generator the engine host hands to
``engine.update_weights(...)``; it must be consumed to the end, since every step is a collective.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class SyncGroup:
    pg: dist.ProcessGroup
    rank: int
    world_size: int
    device: str
    store: dist.TCPStore  # kept alive with the group


def open_sync_group(master_addr: str, master_port: int, rank: int, world_size: int,
                    device: str = "cpu", timeout_s: float = 600.0) -> SyncGroup:
    """Join the weight-sync group (rank 0: trainer rank 0, which hosts the store). Every member calls
    this at about the same time; it returns when all ``world_size`` members have joined."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("instar_weight_sync", store)
    if device == "cuda":
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return SyncGroup(pg=pg, rank=rank, world_size=world_size, device=device, store=store)


def hf_name(name: str) -> str:
    """A trainer parameter name as the engine knows it: the HF name, without the prefixes that
    wrappers (activation checkpointing, torch.compile, FSDP1) insert."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _broadcast(group: SyncGroup, tensor: Tensor) -> Tensor:
    group.pg.broadcast(tensor, 0).wait()
    return tensor


def _send_bucket(group: SyncGroup, table: list[tuple], flat: Tensor) -> None:
    meta = torch.frombuffer(bytearray(pickle.dumps(table)), dtype=torch.uint8).to(group.device)
    _broadcast(group, torch.tensor([meta.numel(), flat.numel()], dtype=torch.int64, device=group.device))
    _broadcast(group, meta)
    _broadcast(group, flat)


def send_weights(named_params: Iterable[tuple[str, Tensor]], group: SyncGroup | None, bucket_mb: float = 256.0,
                 name_map: Callable[[str], str] = hf_name, dtype: torch.dtype | None = None) -> dict[str, float]:
    """Call on every trainer rank (gathering a sharded parameter is collective); only the rank that
    holds ``group`` (trainer rank 0) sends. At most one bucket exists beyond the model: each gathered
    parameter is copied into the bucket buffer and dropped at once. ``name_map`` turns trainer names
    into the engine's; ``dtype`` casts on the way (e.g. to the engine's bfloat16)."""
    start, sent, buckets = time.perf_counter(), 0, 0
    cap = int(bucket_mb * 2**20)
    table: list[tuple] = []
    buffer: Tensor | None = None
    used = 0
    for name, param in named_params:
        if hasattr(param, "full_tensor"):  # a DTensor shard: all-gather it (every trainer rank takes part)
            if param.device.type != param.device_mesh.device_type:  # CPU-offloaded: NCCL gathers on GPU
                param = param.detach().to(param.device_mesh.device_type)
            full = param.full_tensor()
        else:
            full = param
        if group is None:
            continue
        full = full.detach().to(dtype or full.dtype).contiguous()
        nbytes = full.numel() * full.element_size()
        if table and used + nbytes > cap:
            _send_bucket(group, table, buffer[:used])
            sent, buckets, table, used = sent + used, buckets + 1, [], 0
        if buffer is None or nbytes > buffer.numel():
            buffer = torch.empty(max(cap, nbytes), dtype=torch.uint8, device=group.device)
        buffer[used:used + nbytes] = full.reshape(-1).view(torch.uint8).to(group.device)
        table.append((name_map(name), str(full.dtype).removeprefix("torch."), tuple(full.shape), used, nbytes))
        used += nbytes
        del full
    if group is None:
        return {}
    if table:
        _send_bucket(group, table, buffer[:used])
        sent, buckets = sent + used, buckets + 1
    _broadcast(group, torch.zeros(2, dtype=torch.int64, device=group.device))  # end of stream
    seconds = time.perf_counter() - start
    return {"weight_sync/bytes": float(sent), "weight_sync/buckets": float(buckets),
            "weight_sync/seconds": seconds, "weight_sync/mb_per_s": sent / 2**20 / max(seconds, 1e-9)}


def receive_weights(group: SyncGroup) -> Iterator[tuple[str, Tensor]]:
    """On an engine host: yield ``(name, tensor)`` as buckets arrive, until the sender's end marker.
    Tensors are views into the current bucket; copy them (loading into the model does) before the
    next one is requested."""
    while True:
        header = _broadcast(group, torch.empty(2, dtype=torch.int64, device=group.device))
        meta_len, flat_len = header.tolist()
        if meta_len == 0:
            return
        meta = _broadcast(group, torch.empty(meta_len, dtype=torch.uint8, device=group.device))
        table = pickle.loads(bytes(meta.cpu().tolist()))
        flat = _broadcast(group, torch.empty(flat_len, dtype=torch.uint8, device=group.device))
        for name, dtype, shape, offset, nbytes in table:
            yield name, flat[offset:offset + nbytes].view(getattr(torch, dtype)).reshape(shape)

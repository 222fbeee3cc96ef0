"""Weight sync: trainer rank 0 broadcasts full parameters, bucket by bucket, to every engine host
over a dedicated process group, never through Ray's object store. The transport (`Transport`, chosen by
the placement plan): gloo through host memory, NCCL to engines on GPUs of their own, or CUDA IPC to an
engine on trainer rank 0's own GPU (NCCL refuses two ranks on one GPU): there gloo carries the tables
and torch's IPC handle of each bucket, the engine reads the bucket where the trainer wrote it, and a
barrier tells the trainer it may write the next one.

The group is rank 0 = the trainer's rank 0, ranks 1..E = engine hosts, built directly from a
``TCPStore`` so it is independent of the trainer's own process group. Each bucket travels as a
header (three int64: the table's byte length, the flat buffer's, and 1 on the last bucket of the sync),
a JSON table (name, dtype, shape, offset, nbytes per tensor: data, never code as a pickle could be) and
one flat byte buffer in which every tensor starts at a multiple of ``ALIGN`` bytes. Both ends keep each
bucket's table: when it is the same as in the last sync (the usual case) its length is 0 and it is not
sent, so a model in one bucket takes two broadcasts a sync, each a rendezvous of two busy processes. The
receiver is a generator the engine host hands to ``engine.update_weights(...)``; it must be consumed to the
end, since every step is a collective.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from instar.train.launch import open_store

Transport = Literal["gloo", "nccl", "ipc"]
HANDLE_BYTES = 1024  # a bucket's IPC handle, JSON padded to a fixed size: nothing to send ahead of it
ALIGN = 64  # a tensor's offset in its bucket: any dtype can then view its bytes in place

ABANDONED = "instar_sync_abandoned"
"""Set in a group's store once one of its members died (the driver found it): the others leave the broadcast."""
_abandoned: list[SyncGroup] = []  # kept: a dropped gloo group waits in its destructor for the stuck broadcast


class SyncAbandoned(RuntimeError):
    """This weight sync's broadcast is broken (a member died): its members left it; the driver syncs again."""


@dataclass
class SyncGroup:
    pg: dist.ProcessGroup
    rank: int
    device: str  # the group's: "cuda" for NCCL, else "cpu"
    store: dist.TCPStore  # kept alive with the group
    ipc: bool = False  # buckets stay in the sender's GPU memory; the group carries their handles
    buffer: Tensor | None = None
    """CPU only: the sender's (or a ``reuse_buffer`` receiver's) bucket buffer, kept between buckets
    and syncs. Freed host memory goes back to the OS and faulting fresh memory in costs more than
    broadcasting it; on GPU the caching allocator keeps freed memory anyway, and holding it would
    take it from training."""
    sending: Future | None = None  # the sender's background broadcast (`send_weights`), if any
    tables: list[list] = field(default_factory=list)  # each bucket's table in the last sync, both ends

    def wait_sent(self) -> None:
        """Return once a background broadcast has gone out; raise what it raised."""
        sending, self.sending = self.sending, None
        if sending is not None:
            sending.result()


def open_sync_group(master_addr: str, master_port: int, rank: int, world_size: int,
                    transport: Transport = "gloo", timeout_s: float = 600.0) -> SyncGroup:
    """Join the weight-sync group (rank 0: trainer rank 0, which broadcasts). ``master_port``: from
    `reserve_port`, in the process that serves the store (trainer rank 0's). Every member calls this at
    about the same time; it returns when all ``world_size`` members have joined. Where a member cannot
    map CUDA IPC memory (a sandboxed kernel may refuse it), an "ipc" group says so and sends through host
    memory."""
    timeout = timedelta(seconds=timeout_s)
    store = open_store(master_addr, master_port, world_size, timeout)
    prefixed = dist.PrefixStore("instar_weight_sync", store)
    pg = (dist.ProcessGroupNCCL(prefixed, rank, world_size) if transport == "nccl" else
          dist.ProcessGroupGloo(prefixed, rank, world_size, timeout))
    group = SyncGroup(pg=pg, rank=rank, device="cuda" if transport == "nccl" else "cpu", store=store)
    group.ipc = transport == "ipc" and _ipc_works(group)
    return group


def _ipc_handle(flat: Tensor) -> Tensor:
    """torch's CUDA IPC handle of ``flat`` (uint8) as JSON, padded to `HANDLE_BYTES`: data, never a pickle."""
    args = reduce_tensor(flat)[1]  # (tensor class, size, stride, offset, storage class, dtype, device, ...)
    fields = [{"hex": a.hex()} if isinstance(a, bytes) else a for a in (*args[1:4], *args[6:])]
    return torch.frombuffer(bytearray(json.dumps(fields).ljust(HANDLE_BYTES), "utf-8"), dtype=torch.uint8)


def _ipc_open(handle: Tensor) -> Tensor:
    args = [bytes.fromhex(a["hex"]) if isinstance(a, dict) else a for a in json.loads(handle.numpy().tobytes())]
    return rebuild_cuda_tensor(torch.Tensor, *args[:3], torch.TypedStorage, torch.uint8, *args[3:])


def _ipc_works(group: SyncGroup) -> bool:
    """Whether every receiver maps a probe of rank 0's GPU memory and reads it right; one that cannot says why."""
    expected, failed = torch.arange(ALIGN, dtype=torch.uint8), torch.zeros(1)
    handle = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)  # all zeros: rank 0 has no handle to give
    try:
        if group.rank == 0:
            probe = expected.cuda()  # kept until every receiver read it (the all-reduce below)
            handle = _ipc_handle(probe)
    except (RuntimeError, AssertionError) as error:  # no CUDA at all: torch asserts
        failed[0] = _no_ipc(error)
    _broadcast(group, handle)
    try:
        if group.rank and handle.any():
            failed[0] = not torch.equal(_ipc_open(handle).cpu(), expected)
    except RuntimeError as error:  # e.g. a sandboxed kernel's refusal
        failed[0] = _no_ipc(error)
    _wait(group, group.pg.allreduce([failed], dist.ReduceOp.MAX))
    return not failed.item()


def _no_ipc(error: BaseException) -> bool:
    print(f"instar: weight sync: no CUDA IPC here ({error}); the weights go through host memory", flush=True)
    return True


def _broadcast(group: SyncGroup, tensor: Tensor) -> Tensor:
    _wait(group, group.pg.broadcast(tensor, 0))
    return tensor


def _wait(group: SyncGroup, work: dist.Work) -> None:
    """Polled rather than waited for: a member that died would hold the others until the group's timeout."""
    pause, waited = 1e-4, 0.0
    try:
        while not work.is_completed():
            if waited > 1.0 and group.store.check([ABANDONED]):
                group.pg.abort()  # NCCL's kernels stop (gloo's broadcast stays stuck until the group's timeout)
                raise SyncAbandoned("a member of the weight-sync group died: its broadcast is abandoned")
            time.sleep(pause)
            waited, pause = waited + pause, min(2 * pause, 0.05)
        work.wait()
    except RuntimeError as error:  # ours, or gloo's when a member died (its connection closed): all leave
        _abandoned.append(group)
        group.store.set(ABANDONED, "1")
        raise SyncAbandoned(f"the weight-sync broadcast is abandoned: {error}") from error


def _buffer(group: SyncGroup, nbytes: int) -> Tensor:
    """A uint8 buffer of at least ``nbytes`` on the group's device (see ``SyncGroup.buffer``)."""
    if group.buffer is not None and group.buffer.numel() >= nbytes:
        return group.buffer
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if group.ipc else group.device)
    if buffer.device.type == "cpu":
        group.buffer = buffer
    return buffer


def _send_bucket(group: SyncGroup, index: int, table: list[tuple], flat: Tensor, last: bool) -> None:
    same = index < len(group.tables) and group.tables[index] == table
    meta = None if same else torch.frombuffer(bytearray(json.dumps(table), "utf-8"), dtype=torch.uint8)
    handle = _ipc_handle(flat) if group.ipc and flat.numel() else None
    header = [0 if meta is None else meta.numel(), flat.numel(), int(last), handle is not None]
    _broadcast(group, torch.tensor(header, dtype=torch.int64, device=group.device))
    if meta is not None:
        _broadcast(group, meta.to(group.device))
        group.tables[index:index + 1] = [table]
    if handle is not None:
        torch.cuda.current_stream().synchronize()  # the bucket is written before the engine reads it
        _broadcast(group, handle)
        _wait(group, group.pg.barrier())  # the engine has copied it: the buffer may take the next bucket
    elif flat.numel():
        _broadcast(group, flat)


def gathered(param: Tensor) -> Tensor:
    """``param`` whole, detached: a DTensor shard is all-gathered (collective: every rank of its mesh calls)."""
    param = param.detach()
    if hasattr(param, "full_tensor"):
        if param.device.type != param.device_mesh.device_type:  # CPU-offloaded: NCCL gathers on GPU
            param = param.to(param.device_mesh.device_type)
        return param.full_tensor()
    return param


def send_weights(named_params: Iterable[tuple[str, Tensor]], group: SyncGroup | None, bucket_mb: float = 256.0,
                 dtype: torch.dtype | None = None, background: bool = False) -> dict[str, float]:
    """Call on every trainer rank (gathering a sharded parameter is collective); only the rank that
    holds ``group`` (trainer rank 0) sends. At most one bucket buffer exists beyond the model (on CPU
    kept in ``group`` for the next sync): each gathered parameter is copied into it and dropped at
    once. The names go as they are: sharding, compiling and recomputing the trainer's model keep its HF
    parameter names. ``dtype`` casts on the way (e.g. to the engine's bfloat16), in the same copy.
    ``background``: when the whole model fits one bucket of a CPU group, return once it is copied and
    broadcast it from a thread (the trainer computes meanwhile; the copy is the policy of this moment);
    the next send, or ``group.wait_sent()``, waits for it."""
    if group is not None:
        group.wait_sent()  # the previous background broadcast: its buffer is about to be reused
    start, sent, buckets = time.perf_counter(), 0, 0
    cap = int(bucket_mb * 2**20)
    table: list[tuple] = []
    buffer: Tensor | None = None
    used = 0
    for name, param in named_params:
        full = gathered(param)
        if group is None:
            continue
        wire_dtype = dtype or full.dtype
        nbytes = full.numel() * wire_dtype.itemsize
        offset = -(-used // ALIGN) * ALIGN
        if table and offset + nbytes > cap:
            _send_bucket(group, buckets, table, buffer[:used], last=False)
            buckets, table, offset = buckets + 1, [], 0
        if buffer is None or offset + nbytes > buffer.numel():
            buffer = _buffer(group, max(cap, nbytes))
        # one copy: gathers a strided view, casts and moves to the group's device on the way
        buffer[offset:offset + nbytes].view(wire_dtype).view(full.shape).copy_(full)
        table.append((name, str(wire_dtype).removeprefix("torch."), tuple(full.shape), offset, nbytes))
        used, sent = offset + nbytes, sent + nbytes
        del full
    if group is None:
        return {}
    stats = {"weight_sync/bytes": float(sent), "weight_sync/buckets": float(buckets + bool(table))}

    def finish() -> None:  # the last bucket (an empty one for a model without parameters)
        _send_bucket(group, buckets, table, buffer[:used] if table else torch.empty(0, dtype=torch.uint8), last=True)

    if background and buckets == 0 and group.device == "cpu" and not group.ipc:
        group.sending = Future()
        threading.Thread(target=_run, args=(finish, group.sending), name="weight-sync", daemon=True).start()
        return stats | {"weight_sync/seconds": time.perf_counter() - start, "weight_sync/background": 1.0}
    finish()
    seconds = time.perf_counter() - start
    return stats | {"weight_sync/seconds": seconds, "weight_sync/mb_per_s": sent / 2**20 / max(seconds, 1e-9),
                    "weight_sync/background": 0.0}


def _run(fn: Callable[[], None], outcome: Future) -> None:
    """``fn()`` on a thread of its own: what it returns or raises goes to ``outcome`` (`SyncGroup.wait_sent`)."""
    try:
        outcome.set_result(fn())
    except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
        outcome.set_exception(error)


def receive_weights(group: SyncGroup, reuse_buffer: bool = False) -> Iterator[tuple[str, Tensor]]:
    """On an engine host: yield ``(name, tensor)`` as buckets arrive, until the sender's last bucket.
    Tensors are views into their bucket. By default every bucket lands in fresh memory, since vLLM's
    layerwise reload holds views until it has a whole layer. ``reuse_buffer=True`` lands every bucket
    of every sync in one buffer kept in the group (on CPU ~2.5x faster: no page faults, see
    bench/weight_sync.py); only for a consumer that copies each tensor before it asks for the next,
    as ``EmbeddedEngine.update_weights`` does."""
    for index in itertools.count():
        header = _broadcast(group, torch.empty(4, dtype=torch.int64, device=group.device))
        meta_len, flat_len, last, ipc = header.tolist()
        if meta_len:
            meta = _broadcast(group, torch.empty(meta_len, dtype=torch.uint8, device=group.device))
            group.tables[index:index + 1] = [json.loads(meta.cpu().numpy().tobytes())]
        if ipc:  # the sender's own memory: copied out before the barrier lets it write the next bucket
            flat = _ipc_open(_broadcast(group, torch.empty(HANDLE_BYTES, dtype=torch.uint8)))
        elif flat_len:
            flat = _broadcast(group, _buffer(group, flat_len)[:flat_len] if reuse_buffer
                              else torch.empty(flat_len, dtype=torch.uint8, device=group.device))
        for name, dtype, shape, offset, nbytes in group.tables[index] if flat_len else ():
            tensor = flat[offset:offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
            yield name, tensor.clone() if ipc and not reuse_buffer else tensor
        if ipc:
            torch.cuda.current_stream().synchronize()
            del flat, tensor
            _wait(group, group.pg.barrier())
        if last:
            return

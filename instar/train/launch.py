"""Run a function on N trainer ranks as plain local processes (no Ray): used by `instar sft` and by
tests. Each rank gets ``(rank, world_size, master_port, *args)`` and its return value comes back."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def cpu_threads(share: int) -> int:
    """Compute threads for one of ``share`` processes that are busy at the same time on this machine's
    cores: together they use every core, and none oversubscribes them (two processes that each spin
    a thread per core run several times slower)."""
    # The cores this process may run on; macOS has no affinity call, so all of them there.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, share))


class GenerationFlag:
    """Whether rollouts are being generated now, for trainer ranks that share a node's cores with the
    engines and agent runners: the driver sets it as generation starts and stops (`RolloutPool`), each
    rank reads it before each micro-batch and computes with the cores left to it then. In async mode a
    batch generated ahead finishes before the update of a large one does; the rest of the update then
    has every core. One byte in a file on the node (shared memory where there is some)."""

    def __init__(self, path: str | None = None):
        """A new flag (``path`` None: the driver's, unset), or the one at ``path`` (a rank's)."""
        self.owner = path is None
        if path is None:
            fd, path = tempfile.mkstemp(prefix="instar-generating-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                        else None)
            os.pwrite(fd, b"0", 0)
        else:
            fd = os.open(path, os.O_RDWR)
        self.path, self.fd = path, fd

    def set(self, generating: bool) -> None:
        os.pwrite(self.fd, b"1" if generating else b"0", 0)

    def is_set(self) -> bool:
        return os.pread(self.fd, 1, 0) == b"1"

    def unlink(self) -> None:
        """Drop the file's name once every rank holds it open (they keep it alive): a run killed later
        leaves nothing behind in /dev/shm."""
        if self.owner:
            os.unlink(self.path)
            self.owner = False

    def close(self) -> None:
        os.close(self.fd)
        self.unlink()


_held: dict[int, dist.TCPStore] = {}  # stores this process serves, by port, until a rank here joins through one


def reserve_port() -> int:
    """A port for a group's store, bound now by a store served from this process: a port that is only
    found free and bound later by a rank can be taken in between (two runs on one machine, a Ray worker).
    A rank in this process that joins through the port (`open_store`) takes the server over; ranks
    elsewhere connect to it, so this process must outlive the group (later sub-groups meet in it too)."""
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    _held[store.port] = store
    return store.port


def open_store(addr: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The store at ``addr:port`` (see `reserve_port`): served here if this process reserved it."""
    if (store := _held.pop(port, None)) is not None:
        store.set_timeout(timeout)
        return store
    return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.save(fn(rank, world_size, port, *args), os.path.join(out_dir, f"rank{rank}.pt"))


def _wait_all(procs: list, timeout: float | None) -> None:
    """Return when every rank exited cleanly; raise as soon as one fails (the others would otherwise
    wait in a collective until the process-group timeout) or the time, if any, is up."""
    deadline = None if timeout is None else time.monotonic() + timeout
    running = dict(enumerate(procs))
    while running:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait([p.sentinel for p in running.values()], timeout=left)
        if not ready:
            raise TimeoutError(f"trainer ranks {sorted(running)} did not finish within {timeout:.0f} s")
        for r, p in list(running.items()):
            if p.sentinel in ready:
                p.join()
                del running[r]
                if p.exitcode != 0:
                    raise RuntimeError(f"trainer rank {r} of {len(procs)} failed (exit code {p.exitcode}); "
                                       "its traceback is on stderr above")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """Start ``world_size`` spawned processes running ``fn`` (a module-level function), wait for all,
    and return their results in rank order. A rank that dies raises at once, naming its rank and exit
    code, and the others are killed. No time limit unless ``timeout`` (seconds) is given: an SFT
    run takes as long as it takes; tests pass one to fail rather than hang."""
    ctx = mp.get_context("spawn")
    port = reserve_port()  # served from here: every rank connects to it
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, out_dir)) for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            _wait_all(procs, timeout)
        finally:
            for p in procs:
                p.kill()  # a no-op for a rank that has exited
                p.join()
            _held.pop(port, None)  # the ranks are gone: stop serving
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]

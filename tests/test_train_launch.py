"""Local rank launcher: one failing or dying rank fails the run at once and takes the others down;
there is no time limit unless a test asks for one (results in rank order are checked by every
multi-rank test)."""

import os
import socket
import time
from datetime import timedelta

import pytest

from instar.train import launch
from instar.train.launch import run_ranks


def _fail_or_hang(rank, world_size, port, fail_rank):
    if rank == fail_rank:
        raise RuntimeError("boom")
    time.sleep(60)  # a healthy rank stuck waiting for the failed one, as in a collective


def test_a_failing_rank_fails_fast():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="trainer rank 1 of 2 failed"):
        run_ranks(_fail_or_hang, 2, 1, timeout=60)
    assert time.monotonic() - start < 30


def _die_or_hang(rank, world_size, port, pid_dir):
    if rank == 0:
        while not (pid_dir / "rank1").exists():  # the other rank is up and has said who it is
            time.sleep(0.05)
        os._exit(7)  # dies without a Python exception, as on a segfault or the OOM killer's signal
    (pid_dir / f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(60)


def test_a_dying_rank_is_named_with_its_exit_code_and_the_others_are_killed(tmp_path, monkeypatch):
    timeouts = []
    wait = launch.wait
    monkeypatch.setattr(launch, "wait", lambda objects, timeout: (timeouts.append(timeout), wait(objects, timeout))[1])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^trainer rank 0 of 2 failed \(exit code 7\)"):
        run_ranks(_die_or_hang, 2, tmp_path)  # no timeout: a real run may take hours
    assert time.monotonic() - start < 30
    assert timeouts == [None]  # waited with no deadline
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "rank1").read_text()), 0)


def _store_rank(rank, world_size, port):
    store = launch.open_store("127.0.0.1", port, world_size, timedelta(seconds=60))
    store.set(f"rank{rank}", str(rank))
    return [store.get(f"rank{r}").decode() for r in range(world_size)]  # waits for every rank's key


def test_a_reserved_port_stays_bound_and_serves_the_ranks_that_join_through_it():
    """The port is held from the moment it is chosen (a port only found free was taken by another
    program before rank 0 bound it: EADDRINUSE in CI); a rank in the reserving process takes the server
    over, ranks elsewhere connect to it."""
    port = launch.reserve_port()
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", port))
    here = launch.open_store("127.0.0.1", port, 2, timedelta(seconds=60))  # served by this process
    there = launch.open_store("127.0.0.1", port, 2, timedelta(seconds=60))  # a client of it
    there.set("k", "v")
    assert here.get("k") == b"v"
    assert run_ranks(_store_rank, 2, timeout=120) == [["0", "1"]] * 2  # the launcher's ranks: both clients

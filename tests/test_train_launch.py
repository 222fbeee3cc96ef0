"""Local rank launcher: one failing rank fails the run at once (results in rank order are checked by
every multi-rank test)."""

import time

import pytest

from instar.train.launch import run_ranks


def _fail_or_hang(rank, world_size, port, fail_rank):
    if rank == fail_rank:
        raise RuntimeError("boom")
    time.sleep(60)  # a healthy rank stuck waiting for the failed one, as in a collective


def test_a_failing_rank_fails_fast():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="trainer rank 1 of 2 failed"):
        run_ranks(_fail_or_hang, 2, 1)
    assert time.monotonic() - start < 30

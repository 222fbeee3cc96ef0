"""Checkpoints in one process: round trip of model, optimizer, RNG and metadata; pruning; and that
an interrupted save never leaves anything `latest` would resume from. The sharded multi-rank resume
is in test_train_fsdp.py."""

import os
import random

import pytest
import torch
from torch import nn

from instar.train import checkpoint


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt) -> float:
    x = torch.randn(16, 4)  # drawn from the global RNG: a resumed run must draw the same batch
    loss = (model(x) - x.sum(-1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def test_save_load_resumes_the_same_next_step(tmp_path):
    model, opt = _model_and_optimizer(0)
    for _ in range(3):
        _step(model, opt)
    path = checkpoint.save(str(tmp_path), 3, {"net": (model, opt)}, {"extra": {"ledger": [1, 2]}})
    expected, py_next = _step(model, opt), random.random()

    fresh, fresh_opt = _model_and_optimizer(1)  # different init; the load must overwrite it all
    torch.manual_seed(123)
    random.seed(123)
    meta = checkpoint.load(path, {"net": (fresh, fresh_opt)})
    assert meta["step"] == 3 and meta["extra"] == {"ledger": [1, 2]}
    assert _step(fresh, fresh_opt) == expected
    assert random.random() == py_next
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "meta.pt", "rng_rank0.pt"]


def test_latest_picks_the_newest_complete_checkpoint_and_prunes(tmp_path):
    model, opt = _model_and_optimizer(0)
    assert checkpoint.latest(str(tmp_path / "missing")) is None
    for step in (1, 2, 3):
        checkpoint.save(str(tmp_path), step, {"net": (model, opt)}, {}, max_num=2)
    assert sorted(os.listdir(tmp_path)) == ["step_2", "step_3"]
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_3")


def test_an_interrupted_save_is_never_resumed_from(tmp_path):
    model, opt = _model_and_optimizer(0)
    checkpoint.save(str(tmp_path), 1, {"net": (model, opt)}, {})
    _step(model, opt)
    # The shards are written, then the metadata fails to pickle: the save dies half way.
    with pytest.raises(Exception, match="lambda"):
        checkpoint.save(str(tmp_path), 2, {"net": (model, opt)}, {"extra": {"bad": lambda: 0}})
    assert os.path.isdir(tmp_path / "step_2.tmp")
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_1")
    # a complete-looking temp dir (killed right before the rename) does not count either
    os.rename(tmp_path / "step_2.tmp", tmp_path / "step_9.tmp")
    torch.save({"step": 9, "world_size": 1}, tmp_path / "step_9.tmp" / "meta.pt")
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_1")
    # the next save of that step replaces the leftover
    checkpoint.save(str(tmp_path), 9, {"net": (model, opt)}, {})
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_9"]
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_9")


def test_load_refuses_another_world_size(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = checkpoint.save(str(tmp_path), 1, {"net": (model, opt)}, {})
    torch.save({"step": 1, "world_size": 4}, os.path.join(path, "meta.pt"))
    with pytest.raises(ValueError, match="saved by 4 ranks but 1 are running"):
        checkpoint.load(path, {"net": (model, opt)})

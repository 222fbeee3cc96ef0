"""Checkpoints in one process: round trip of model, optimizer, RNG and metadata; pruning; that an
interrupted save never leaves anything `latest` would resume from, and that a damaged checkpoint is
skipped for the one before it, and that a planted pickle is refused without running. The sharded
multi-rank resume is in test_train_fsdp.py."""

import os
import pickle
import random
from fractions import Fraction

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


def test_another_world_size_loads_the_weights_and_keeps_the_rng(tmp_path):
    """Resharding across layouts itself is tested over gloo in test_parallel.py."""
    model, opt = _model_and_optimizer(0)
    path = checkpoint.save(str(tmp_path), 1, {"net": (model, opt)}, {})
    torch.save({"step": 1, "world_size": 4}, os.path.join(path, "meta.pt"))  # as if saved by 4 ranks
    other, other_opt = _model_and_optimizer(1)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    assert checkpoint.load(path, {"net": (other, other_opt)})["world_size"] == 4
    assert torch.equal(torch.get_rng_state(), rng)  # rank 0 of 4 is not this rank's counterpart
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def _three_checkpoints(root):
    model, opt = _model_and_optimizer(0)
    for step in (1, 2, 3):
        checkpoint.save(str(root), step, {"net": (model, opt)}, {})


@pytest.mark.parametrize("damage,problem", [
    (lambda d: (d / "meta.pt").write_bytes(bytes((d / "meta.pt").stat().st_size)), "meta.pt: RuntimeError"),
    (lambda d: os.truncate(d / "rng_rank0.pt", 10), "rng_rank0.pt: RuntimeError"),
    (lambda d: os.truncate(d / "__0_0.distcp", 100), "__0_0.distcp: missing or truncated"),
    # killed during a save whose files were renamed into place but never reached the disk
    (lambda d: [os.remove(d / f) for f in ("rng_rank0.pt", "__0_0.distcp")], "rng_rank0.pt: FileNotFoundError"),
    (lambda d: os.remove(d / ".metadata"), ".metadata: FileNotFoundError"),
])
def test_latest_skips_a_damaged_checkpoint_for_the_one_before(tmp_path, damage, problem):
    _three_checkpoints(tmp_path)
    damage(tmp_path / "step_3")
    with pytest.warns(UserWarning) as caught:
        assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_2")
    assert str(caught[0].message) == (f"skipped unreadable checkpoint(s) {tmp_path}/step_3 ({problem}); "
                                      f"resuming from {tmp_path}/step_2")


def test_latest_refuses_when_every_checkpoint_is_damaged(tmp_path):
    _three_checkpoints(tmp_path)
    for step in (1, 2, 3):
        os.truncate(tmp_path / f"step_{step}" / "meta.pt", 0)
    with pytest.raises(ValueError, match=rf"^no readable checkpoint in {tmp_path}: {tmp_path}/step_3 \(meta.pt: "):
        checkpoint.latest(str(tmp_path))


def test_save_fsyncs_every_file_before_the_rename(tmp_path, monkeypatch):
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd)))
    model, opt = _model_and_optimizer(0)
    checkpoint.save(str(tmp_path), 1, {"net": (model, opt)}, {})
    tmp = str(tmp_path / "step_1.tmp")
    assert {f"{tmp}/meta.pt", f"{tmp}/rng_rank0.pt"} <= set(synced)  # dcp fsyncs the shards itself
    assert synced[-2:] == [tmp, str(tmp_path)]  # the directory entries, before and after the rename


class _Mkdir:
    """Unpickled, this creates a directory: the proof that a load ran code it was handed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_planted_pickle_is_refused_and_never_run(tmp_path):
    model, opt = _model_and_optimizer(0)
    for step in (1, 2):
        checkpoint.save(str(tmp_path / "ckpt"), step, {"net": (model, opt)}, {})
    planted = tmp_path / "ckpt" / "step_2"
    for name in ("meta.pt", "rng_rank0.pt"):
        torch.save({"step": 2, "world_size": 1, "x": _Mkdir(str(tmp_path / f"ran_{name}"))}, planted / name)
    with pytest.warns(UserWarning, match=r"step_2 \(meta.pt: UnpicklingError\)"):
        assert checkpoint.latest(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / "step_1")
    with pytest.raises(pickle.UnpicklingError, match="GLOBAL posix.mkdir"):
        checkpoint.load(str(planted), {"net": (model, opt)})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_meta_that_load_could_not_read_fails_the_save(tmp_path):
    model, opt = _model_and_optimizer(0)
    checkpoint.save(str(tmp_path), 1, {"net": (model, opt)}, {})
    with pytest.raises(pickle.UnpicklingError, match="fractions.Fraction"):
        checkpoint.save(str(tmp_path), 2, {"net": (model, opt)}, {"extra": {"kl": Fraction(1, 3)}})
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_1")

"""--train.rollout_dump_dir: a run deletes the dumps of the steps it trains, so it must not write into the
directory it replays, nor start fresh over another run's dumps."""

import pytest

from instar.checks import check
from instar.config import ConfigError, RLConfig


def _cfg(dump, replay=None, **ckpt) -> RLConfig:
    cfg = RLConfig()
    cfg.train.rollout_dump_dir, cfg.train.rollout_replay_dir = str(dump), replay and str(replay)
    for name, value in ckpt.items():
        setattr(cfg.ckpt, name, value)
    return cfg


def test_dumping_into_the_replayed_directory_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    for dump, replay in ((tmp_path / "d", tmp_path / "d"), (tmp_path / "d", f"{tmp_path}/x/../d/")):
        with pytest.raises(ConfigError) as e:
            check(_cfg(dump, replay, load_enable=True))
        assert str(e.value) == (f"--train.rollout_dump_dir and --train.rollout_replay_dir are the same directory "
                                f"({dump}); a run deletes the dumps of the steps it trains: dump elsewhere")
    check(_cfg(tmp_path / "new", tmp_path / "d"))


def test_a_fresh_run_refuses_a_dump_directory_that_holds_dumps_unless_overwrite_or_resume(tmp_path):
    (tmp_path / "eval_step_1.jsonl").write_text("")  # not a training rollout dump
    check(_cfg(tmp_path))
    check(_cfg(tmp_path / "missing"))
    (tmp_path / "step_000001.jsonl").write_text("")
    with pytest.raises(ConfigError) as e:
        check(_cfg(tmp_path))
    assert str(e.value) == (f"--train.rollout_dump_dir {tmp_path} holds another run's dumps; resume that run "
                            "(--ckpt.load_enable), delete them (--ckpt.overwrite) or choose another directory")
    check(_cfg(tmp_path, overwrite=True))
    check(_cfg(tmp_path, load_enable=True))

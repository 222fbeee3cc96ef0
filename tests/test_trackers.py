"""rl, sft and eval report to the same sinks; W&B (offline) keeps one run across a resume. The W&B
files are read back record by record, so the test sees what `wandb sync` would upload."""

import json
import struct
from pathlib import Path
from unittest.mock import Mock

import pytest

from instar.config import ActorConfig, CkptConfig, FSDPConfig, LogConfig, SFTConfig, SFTSection
from instar.train.run_dir import MetricsLogger
from instar.train.sft import run_sft

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")  # in the dev extras: never skipped by `make test`


def wandb_runs(run_dir: Path) -> list[tuple[str, str, dict[int, dict]]]:
    """(run id, job type, {step: logged values}) of each offline W&B run under ``run_dir``, oldest first (by
    the run's start time: the directory names order runs that start within one second by their ids)."""
    out = []
    for path in run_dir.glob("wandb/offline-run-*/run-*.wandb"):
        run_id = job = ""
        started = 0
        history: dict[int, dict] = {}
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id, job = record.run.run_id, record.run.job_type
                started = record.run.start_time.seconds * 10**9 + record.run.start_time.nanos
            elif kind == "history":
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
        out.append((started, run_id, job, history))
    return [run[1:] for run in sorted(out)]


def _records(path: Path) -> list:
    """A .wandb file: a 7-byte header, then a LevelDB log (32 KiB blocks of records, each with a 7-byte
    header: checksum, length, type 1 = whole, 2/3/4 = first/middle/last piece)."""
    data, records, piece, pos = path.read_bytes()[7:], [], b"", 0
    while pos + 7 <= len(data):
        if 32768 - (pos + 7) % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - (pos + 7) % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        piece, pos = piece + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            records.append(pb.Record.FromString(piece))
            piece = b""
    return records


def test_a_resumed_job_logs_into_the_same_wandb_run_and_each_eval_into_its_own(tmp_path):
    cfg = LogConfig(wandb_project="instar-test", wandb_mode="offline")
    first = MetricsLogger(tmp_path, cfg, total_steps=4, job="rl")
    for step in (1, 2, 3):
        first.log(step, {"reward": step / 10})
    first.close()  # killed after step 3; the checkpoint was at step 2
    again = MetricsLogger(tmp_path, cfg, total_steps=4, start_step=2, job="rl")
    again.truncate_after(2)
    for step in (3, 4):
        again.log(step, {"reward": step / 5})
    again.close()
    for _ in range(2):
        evaluation = MetricsLogger(tmp_path, cfg, total_steps=1, job="eval")
        evaluation.log(0, {"model": "m", "eval/accuracy": 0.5})
        evaluation.close()
    (a, job_a, steps_a), (b, _, steps_b), (e1, job_e, eval_1), (e2, _, _) = wandb_runs(tmp_path)
    assert a == b == (tmp_path / "wandb_run_id").read_text() and job_a == "rl"
    assert steps_a == {1: {"reward": 0.1}, 2: {"reward": 0.2}, 3: {"reward": 0.3}}
    assert steps_b == {3: {"reward": 0.6}, 4: {"reward": 0.8}}
    assert len({a, e1, e2}) == 3 and job_e == "eval" and eval_1 == {0: {"eval/accuracy": 0.5}}
    assert [r["reward"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())] == [
        0.1, 0.2, 0.6, 0.8]
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 2


def test_sft_reports_to_tensorboard_and_wandb_and_a_resumed_sft_continues_its_wandb_run(tiny_model_dir, tmp_path):
    with open(tmp_path / "task.jsonl", "w") as f:
        for a in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"echo {a}"},
                                             {"role": "assistant", "content": f"{a}"}]}) + "\n")

    def sft(epochs: int, resume: bool) -> dict:  # 32 training conversations / 8 = 4 steps an epoch
        return run_sft(SFTConfig(
            actor=ActorConfig(model_name_or_path=str(tiny_model_dir)), fsdp=FSDPConfig(num_ranks=1),
            sft=SFTSection(dataset=str(tmp_path / "task.jsonl"), batch_size=8, epochs=epochs, eval_fraction=0.2,
                           max_tokens_per_gpu=128), ckpt=CkptConfig(output_dir=str(tmp_path), load_enable=resume),
            log=LogConfig(tensorboard=True, wandb_project="instar-test")))

    assert sft(1, False)["step"] == 4
    assert sft(2, True)["step"] == 8  # resumes from the step-4 checkpoint
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(9)) and {"actor/loss", "epoch"} <= set(rows[1])
    (a, job, first), (b, _, second) = wandb_runs(tmp_path)
    assert a == b and job == "sft" and sorted(first) == [0, 1, 2, 3, 4] and sorted(second) == [5, 6, 7, 8]
    assert second[8]["actor/loss"] == pytest.approx(rows[8]["actor/loss"])
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.fixture
def wandb_inits(monkeypatch) -> list[dict]:
    """The arguments of each `wandb.init`, which starts nothing."""
    import wandb

    seen: list[dict] = []
    monkeypatch.setattr(wandb, "init", lambda **kw: seen.append(kw) or Mock())
    return seen


@pytest.mark.parametrize("flag, env, mode", [(None, None, "offline"), (None, "online", "online"),
                                             ("offline", "online", "offline"), ("online", None, "online")])
def test_wandb_mode_is_the_flag_else_WANDB_MODE_else_offline(tmp_path, monkeypatch, wandb_inits, flag, env, mode):
    if env is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env)
    MetricsLogger(tmp_path, LogConfig(wandb_project="p", wandb_mode=flag), total_steps=1).close()
    assert wandb_inits[0]["mode"] == mode


def test_a_fresh_run_starts_a_new_wandb_run_over_the_id_a_dead_run_left(tmp_path, wandb_inits):
    (tmp_path / "wandb_run_id").write_text("0123456789abcdef")  # of a run killed before its first checkpoint
    for start in (0, 2):  # the fresh run, then that run resumed
        MetricsLogger(tmp_path, LogConfig(wandb_project="p"), total_steps=4, start_step=start).close()
    fresh, resumed = (kw["id"] for kw in wandb_inits)
    assert fresh != "0123456789abcdef" and fresh == resumed == (tmp_path / "wandb_run_id").read_text()

"""metrics.jsonl (+ TensorBoard), resume truncation (torn last line included), and the run report."""

import json

from instar.cli.main import main
from instar.config import LogConfig
from instar.train.run_dir import MetricsLogger


def test_logger_writes_jsonl_and_tensorboard_and_truncates(tmp_path):
    log = MetricsLogger(tmp_path, LogConfig(tensorboard=True), total_steps=3)
    log.log(0, {"eval/accuracy": 0.25, "eval_greedy/accuracy": 0.5})
    for step in (1, 2, 3):
        log.log(step, {"reward": step / 4, "time/step": 1.0, "nan_metric": float("nan")})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2] == {"step": 2, "nan_metric": None, "reward": 0.5, "time/step": 1.0}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    log = MetricsLogger(tmp_path, LogConfig(), total_steps=3, start_step=1)
    log.truncate_after(1)  # a run resumed from step 1 redoes steps 2 and 3
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_truncate_drops_a_torn_last_line(tmp_path):
    rows = "".join(json.dumps({"step": s, "reward": s / 4}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 4, "rew')  # killed in the middle of a write
    log = MetricsLogger(tmp_path, LogConfig(), total_steps=4, start_step=2)
    log.truncate_after(2)
    log.log(3, {"reward": 1.0})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [
        '{"step": 1, "reward": 0.25}', '{"step": 2, "reward": 0.5}', '{"step": 3, "reward": 1.0}']
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_report_prints_the_before_after_line(tmp_path, capsys):
    rows = [{"step": 0, "eval/accuracy": 0.3, "eval_greedy/accuracy": 0.6}]
    rows += [{"step": s, "reward": s / 10, "time/step": 2.0, "time/train": 1.0} for s in range(1, 6)]
    rows[-1] |= {"eval/accuracy": 0.9, "eval_greedy/accuracy": 0.95}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["report", "--run_dir", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "eval accuracy: before=0.3 after=0.9"
    assert "mean time/step (s): 2.0" in out
    assert (tmp_path / "curve.png").stat().st_size > 1000
    assert "<img src='curve.png'" in (tmp_path / "report.html").read_text()

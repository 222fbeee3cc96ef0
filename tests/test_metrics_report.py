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


def test_report_draws_the_curves_logged_and_tables_each_evaluation(tmp_path):
    from instar.cli.report import charts_for, write_report

    rows = [{"step": 0, "eval/accuracy": 0.25, "eval/pass@4": 0.5, "eval_greedy/accuracy": 0.3}]
    rows += [{"step": s, "reward": 0.1 * s, "actor/entropy": 1.0 / s, "actor/vllm_kl": 0.0 if s % 2 else 1e-4,
              "actor/is_filter_ratio": 0.01, "actor/policy_clip_ratio": 0.02, "response_length": 30 + s,
              "engine/idle_fraction": 0.3, "time/trainer_idle": 0.1, "time/logprobs": 0.05, "time/train": 0.3,
              "time/weight_sync": 0.05, "time/step": 0.6} for s in range(1, 41)]
    rows[-1] |= {"eval/accuracy": 0.75, "eval/pass@4": 0.875, "eval_greedy/accuracy": 0.8}
    assert charts_for(rows) == ["reward and eval accuracy", "policy entropy", "engine vs trainer: vllm_kl",
                                "IS filter and clip fractions", "response length", "engine idle and agent CPU",
                                "step time split"]  # no grad norm logged: no empty chart
    assert charts_for(rows[:1]) == ["reward and eval accuracy"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png, page, summary = write_report(tmp_path)
    text = page.read_text()
    evals = text.split("<h2>Evaluations</h2>")[1].split("</table>")[0]
    assert evals == ("<table><tr><th>step</th><th>eval/accuracy</th><th>eval/pass@4</th><th>eval_greedy/accuracy</th>"
                     "</tr><tr><td>0</td><td>0.250</td><td>0.500</td><td>0.300</td></tr>"
                     "<tr><td>40</td><td>0.750</td><td>0.875</td><td>0.800</td></tr>")
    assert "<tr><td>mean time/train (s)</td><td>0.300</td></tr>" in text
    assert summary["eval accuracy after"] == 0.75 and png.stat().st_size > 50_000

"""A run's report: reward / accuracy curves as a PNG and a short HTML page, from metrics.jsonl."""

from __future__ import annotations

import html
import json
from pathlib import Path

CURVES = ("reward", "eval/accuracy", "eval_greedy/accuracy")
TIMES = ("time/trainer_idle", "time/logprobs", "time/train", "time/weight_sync", "time/step")


def write_report(run_dir: str | Path, title: str = "instar run") -> tuple[Path, Path, dict]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    if not (run / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run / 'metrics.jsonl'} not found; pass the run's --ckpt.output_dir")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in CURVES:
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker="." if key == "reward" else "o", label=key)
    ax.set(xlabel="step", ylabel="fraction / mean reward", ylim=(-0.02, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    png = run / "curve.png"
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)

    train = [r for r in rows if "time/step" in r]
    first = next((r for r in rows if "eval/accuracy" in r), {})
    last = next((r for r in reversed(rows) if "eval/accuracy" in r), {})
    summary = {"steps": len(train), "eval accuracy before": first.get("eval/accuracy"),
               "eval accuracy after": last.get("eval/accuracy"),
               "greedy accuracy before": first.get("eval_greedy/accuracy"),
               "greedy accuracy after": last.get("eval_greedy/accuracy"),
               **{f"mean {k} (s)": _mean(train, k) for k in TIMES},
               "mean engine idle fraction": _mean(train, "engine/idle_fraction"),
               "mean agent-actor cpu fraction": _mean(train, "agent/cpu_fraction")}
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{_fmt(v)}</td></tr>" for k, v in summary.items())
    page = run / "report.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
                    f"<body><h1>{html.escape(title)}</h1><img src='curve.png' alt='reward and accuracy curves'>"
                    f"<table>{cells}</table><p>Per-step metrics: metrics.jsonl</p></body></html>\n")
    return png, page, summary


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _fmt(v: object) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

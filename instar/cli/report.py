"""A run's report from metrics.jsonl: the curves people read when a run goes wrong (one PNG of small
charts), the eval table (accuracy and pass@k at each evaluation) and a summary, as one HTML page."""

from __future__ import annotations

import html
import json
from pathlib import Path

# (title, y label, metric keys, log scale): a chart is drawn when its run logged any of the keys. The
# log scale is symlog: an estimate of a KL is often exactly 0 (engine and trainer agree to the bit).
CHARTS = (
    ("reward and eval accuracy", "fraction / mean reward", ("reward", "eval/accuracy", "eval_greedy/accuracy"), False),
    ("policy entropy", "nats / token", ("actor/entropy",), False),
    ("engine vs trainer: vllm_kl", "KL (symlog)", ("actor/vllm_kl",), True),
    ("IS filter and clip fractions", "fraction of tokens", ("actor/is_filter_ratio", "actor/policy_clip_ratio"), False),
    ("response length", "tokens", ("response_length",), False),
    ("grad norm", "norm", ("actor/grad_norm",), False),
    ("engine idle and agent CPU", "fraction", ("engine/idle_fraction", "agent/cpu_fraction"), False),
)
# The step split, stacked: generation wait (trainer idle), logprobs, update, weight sync, and the rest.
SPLIT = ("time/trainer_idle", "time/logprobs", "time/train", "time/weight_sync")
STYLE = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin:1em 0}"
         "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}td:first-child{text-align:left}")


def write_report(run_dir: str | Path, title: str = "instar run") -> tuple[Path, Path, dict]:
    run = Path(run_dir)
    if not (run / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run / 'metrics.jsonl'} not found; pass the run's --ckpt.output_dir")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    png = _plot(rows, run / "curve.png")
    train = [r for r in rows if "time/step" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    summary = {"steps": len(train), "eval accuracy before": first.get("eval/accuracy"),
               "eval accuracy after": last.get("eval/accuracy"),
               "greedy accuracy before": first.get("eval_greedy/accuracy"),
               "greedy accuracy after": last.get("eval_greedy/accuracy"),
               **{f"mean {k} (s)": _mean(train, k) for k in (*SPLIT, "time/step")},
               "mean engine idle fraction": _mean(train, "engine/idle_fraction"),
               "mean agent-actor cpu fraction": _mean(train, "agent/cpu_fraction")}
    page = run / "report.html"
    body = (f"<img src='{png.name}' alt='training curves'><h2>Evaluations</h2>{_table(evals)}<h2>Summary</h2>"
            + _table([{"": k, "value": v} for k, v in summary.items()]) + "<p>Per-step metrics: metrics.jsonl</p>")
    page.write_text(html_page(title, STYLE, body))
    return png, page, summary


def html_page(title: str, style: str, body: str) -> str:
    """A whole HTML page: ``title`` as its title and first heading, then ``body``."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n")


def charts_for(rows: list[dict]) -> list[str]:
    """Titles of the charts the report draws for ``rows``, in order."""
    drawn = [c[0] for c in CHARTS if any(r.get(k) is not None for r in rows for k in c[2])]
    return drawn + ["step time split"] * any(r.get("time/step") is not None for r in rows)


def _plot(rows: list[dict], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = charts_for(rows)
    charts = [c for c in CHARTS if c[0] in names]
    split = [r for r in rows if r.get("time/step") is not None]
    n = len(names)
    fig, axes = plt.subplots((n + 1) // 2, 2, figsize=(12, 3.2 * ((n + 1) // 2)), squeeze=False)
    for ax, (name, ylabel, keys, log) in zip(axes.flat, charts):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, label=key)
        ax.set(title=name, xlabel="step", ylabel=ylabel)
        if log:
            ax.set_yscale("symlog", linthresh=1e-6)
    if split:
        ax = axes.flat[len(charts)]
        parts = [[r.get(k) or 0.0 for r in split] for k in SPLIT]
        parts.append([max(r["time/step"] - sum(p[i] for p in parts), 0.0) for i, r in enumerate(split)])
        w = max(1, len(split) // 25)  # a step's split varies with its rollouts: the mean of w steps reads better
        parts = [[sum(p[i:i + w]) / len(p[i:i + w]) for i in range(0, len(p), w)] for p in parts]
        steps = [split[min(i + w - 1, len(split) - 1)]["step"] for i in range(0, len(split), w)]
        ax.stackplot(steps, *parts, labels=["generation wait", "logprobs", "update", "weight sync", "other"])
        ax.set(title=f"step time split (mean of {w} steps)", xlabel="step", ylabel="seconds")
    for ax in axes.flat[:n]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def _table(rows: list[dict]) -> str:
    """An HTML table of ``rows`` (columns: the keys, in first-seen order); eval rows keep the eval keys."""
    if not rows:
        return "<p>none logged</p>"
    cols = list(dict.fromkeys(k for r in rows for k in r
                              if k in ("", "value", "step") or k.startswith(("eval/", "eval_greedy/"))))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _fmt(v: object) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else html.escape(str(v))

"""Render the pages a user reads, `report.html` and `instar view`'s trajectory page, in headless Chromium
(Debian's `chromium` package) and check what it drew.

    .venv/bin/python bench/render_pages.py [--run_dir RUN [--dump DUMP]] [--out runs/pages]

Without --run_dir it makes a short run of its own (the tiny model on the calculator task, 4 RL steps with
eval pass@2 and rollout dumps; one prompt carries multi-byte text). Each page gets a screenshot
(`<out>/<page>.png`: look at them) and checks of the DOM Chromium built: charts loaded, tables filled,
multi-byte characters shown whole. One `PASS` / `FAIL name: detail` line per check; exit 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SAMPLE = "Café ☕ — 世界: "  # two- three- and (in the emoji) multi-byte UTF-8, in a prompt the view shows


def make_run(out: Path) -> Path:
    def run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, cwd=out, stdout=subprocess.DEVNULL)

    run(str(BIN / "instar"), "tiny-model", "--out", "model")
    run(str(BIN / "python"), str(ROOT / "examples/calculator/task.py"), "data")
    rows = (out / "data/train.jsonl").read_text().splitlines()
    first = json.loads(rows[0])
    first["prompt"][-1]["content"] = SAMPLE + first["prompt"][-1]["content"]  # the task's prompts are chat messages
    (out / "data/train.jsonl").write_text("\n".join([json.dumps(first, ensure_ascii=False), *rows[1:]]) + "\n")
    run(str(BIN / "instar"), "rl", "--config", str(ROOT / "examples/calculator/rl.yaml"),
        "--actor.model_name_or_path", "model", "--data.prompt_dataset", "data/train.jsonl", "--data.shuffle", "false",
        "--train.agent_path", str(ROOT / "examples/calculator/task.py"), "--train.max_steps", "4",
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--eval.dataset", "data/eval.jsonl",
        "--eval.steps", "2", "--eval.n_samples", "2", "--train.rollout_dump_dir", "rl/rollouts",
        "--ckpt.output_dir", "rl")
    return out / "rl"


def render(page: Path, png: Path) -> str:
    """Chromium's screenshot of ``page`` into ``png``, and the DOM it built (after the page loaded)."""
    chrome = shutil.which("chromium") or shutil.which("chromium-browser")
    if chrome is None:
        sys.exit("no chromium on PATH: apt-get install chromium")
    flags = [chrome, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1900"]
    subprocess.run([*flags, f"--screenshot={png}", page.as_uri()], check=True, capture_output=True, timeout=120)
    return subprocess.run([*flags, "--dump-dom", page.as_uri()], check=True, capture_output=True, text=True,
                          timeout=120).stdout


def text_of(dom: str) -> str:
    """The text a reader sees in ``dom`` (tags dropped, entities decoded)."""
    parts: list[str] = []
    parser = HTMLParser()
    parser.handle_data = parts.append
    parser.feed(dom)
    return "".join(parts)


def drawn(png: Path) -> float:
    """The fraction of the screenshot's pixels that are not the background: 0 is a blank page."""
    from PIL import Image

    image = Image.open(png).convert("L")
    background = max(image.getcolors(1 << 20) or [(0, 255)])[1]
    return sum(1 for p in image.get_flattened_data() if abs(p - background) > 16) / (image.width * image.height)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run_dir", type=Path, help="a finished run (its --ckpt.output_dir); default: make one")
    p.add_argument("--dump", type=Path, help="its rollout dump for the view (default: <run_dir>/rollouts)")
    p.add_argument("--out", type=Path, default=ROOT / "runs/pages")
    args = p.parse_args()
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run = args.run_dir.resolve() if args.run_dir else make_run(out)
    subprocess.run([str(BIN / "instar"), "report", "--run_dir", str(run)], check=True, stdout=subprocess.DEVNULL)
    dump, model = (args.dump or run / "rollouts").resolve(), run.parent / "model"
    subprocess.run([str(BIN / "instar"), "view", "--path", str(dump), "--tokenizer", str(model if model.is_dir()
                    else run / "hf"), "--out", str(out / "view.html")], check=True, stdout=subprocess.DEVNULL)
    checks: list[tuple[str, bool, str]] = []
    dom = render(run / "report.html", out / "report.png")
    fraction = drawn(out / "report.png")
    checks += [("report drawn", fraction > 0.05, f"{fraction:.0%} of the screenshot is not background"),
               ("report chart", "<img src=\"curve.png\"" in dom and (run / "curve.png").stat().st_size > 50_000,
                f"curve.png {(run / 'curve.png').stat().st_size} bytes"),
               ("report eval table", "eval/pass@2" in dom and "eval_greedy/accuracy" in dom,
                "columns eval/pass@2 and eval_greedy/accuracy"),
               ("report summary", "mean time/step (s)" in dom and "n/a</td>" not in dom.split("Summary")[-1][:400],
                "summary rows filled")]
    dom = render(out / "view.html", out / "view.png")
    sampled = dom.count('class="a"')
    fraction = drawn(out / "view.png")
    checks += [("view drawn", fraction > 0.05, f"{fraction:.0%} of the screenshot is not background"),
               ("view trajectories", dom.count("<section") >= 2, f"{dom.count('<section')} trajectory sections"),
               ("view sampled tokens", sampled > 10, f"{sampled} sampled-token spans")]
    if not args.run_dir:
        text = text_of(dom).replace("\u21b5", "")
        checks.append(("view multi-byte text", SAMPLE in text, f"{SAMPLE!r} shown whole (a random model's own "
                       f"bytes need not be UTF-8: {text.count(chr(0xFFFD))} U+FFFD in its samples)"))
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    print(f"screenshots: {out / 'report.png'} {out / 'view.png'}")
    sys.exit(0 if all(ok for _, ok, _ in checks) else 1)


if __name__ == "__main__":
    main()

"""kill -9 at random moments of a CPU RL run, resuming after each, then check the data ledger: every
prompt trained exactly once per epoch it was drawn in, across all the restarts.

The run is the real `instar rl` topology on the tiny model (Ray, embedded engine, agent runner, FSDP2
trainer rank) with a checkpoint every step. Each attempt is killed with SIGKILL on its whole process
group (the driver and every Ray process), then resumed with --ckpt.load_enable true; the attempt after
the last kill runs to the end. Kill moments are seeded and of two kinds, so they land in every phase:
- start-up: a uniform delay after the launch, shorter than the last attempt's start-up (Ray starting,
  actors loading, a checkpoint being restored; the first kill comes before any checkpoint exists);
- in a step: once the attempt has logged step ckpt+1 or ckpt+2, a uniform delay within one step
  (generation, training, weight sync, ledger and metrics writes, the checkpoint save, the final export).
Then it checks: ledger `trained` rows unique per (epoch, prompt_index), --steps x --batch-size of them,
--batch-size per step; every epoch complete but the last few (what was in flight at the end);
metrics.jsonl steps exactly 1..--steps; the final checkpoint and HF export exist; no process of any
attempt survives. It prints the kill table and PASS or FAIL (exit status 1).

    OMP_NUM_THREADS=1 python bench/kill_resume.py [--kills 10] [--seed 0] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
IN_FLIGHT = 4  # --rollout.max_groups_in_flight: prompt groups handed out but not yet trained, at most


@dataclass
class Kill:
    attempt: int
    kind: str  # "start-up" or "step"
    at_s: float  # seconds after the attempt's launch
    step_seen: int  # last complete metrics step of this attempt at the kill (0: none yet)
    ckpt_before: int  # the checkpoint the attempt resumed from
    phase: str


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=10, help="SIGKILLs before the attempt that runs to the end")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    p.add_argument("--steps", type=int, default=20, help="--train.max_steps (leaves room for ~1.5 steps per kill)")
    p.add_argument("--batch-size", type=int, default=2, help="--rollout.batch_size (prompt groups per step)")
    p.add_argument("--prompts", type=int, default=5, help="dataset size: small, so resumes land in many epochs")
    p.add_argument("--attempt-timeout", type=float, default=240, help="seconds one attempt may take")
    p.add_argument("--workdir", default="", help="where the model, data and run go (default: a new temp dir)")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kill_resume_"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    cmd = prepare(work, args)
    kills, failures = attack(work, cmd, args)
    failures += verify(work / "run", args)
    print_table(kills)
    wall = time.time() - t_start
    for f in failures:
        print(f"FAIL: {f}")
    if len(kills) < args.kills:
        print(f"note: an attempt finished before its kill came; {len(kills)} of {args.kills} kills done")
    verdict = "FAIL" if failures else "PASS"
    print(f"{verdict}: {len(kills)} kills, {len(kills) + 1} attempts, {wall:.0f} s wall; run dir {work}")
    return 1 if failures else 0


def prepare(work: Path, args) -> list[str]:
    """The tiny model, a prompt file and the recipe; returns the `instar rl` command line."""
    model = work / "tiny"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "instar", "tiny-model", "--out", str(model)], check=True, env=ENV,
                       stdout=subprocess.DEVNULL)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i}*7+3?", "label": str(i * 7 + 3)}) + "\n"
                               for i in range(args.prompts)))
    recipe = work / "recipe.yaml"
    recipe.write_text(json.dumps({
        "actor": {"model_name_or_path": str(model), "learning_rate": 1e-3},
        "data": {"prompt_dataset": str(prompts), "max_new_tokens": 24, "max_len": 256},
        "train": {"agent_path": str(ROOT / "tests/agents/length_env.py"), "max_steps": args.steps},
        "rollout": {"batch_size": args.batch_size, "n_samples_per_prompt": 4, "max_groups_in_flight": IN_FLIGHT},
        "ckpt": {"output_dir": str(work / "run"), "save_steps": 1}}, indent=1))
    return [sys.executable, "-m", "instar", "rl", "--config", str(recipe)]


def attack(work: Path, cmd: list[str], args) -> tuple[list[Kill], list[str]]:
    """Launch, kill, resume until an attempt survives; returns the kills and any failures seen."""
    rng = random.Random(args.seed)
    n_startup = max(1, round(0.3 * args.kills))
    kinds = ["start-up"] + rng.sample(["start-up"] * (n_startup - 1) + ["step"] * (args.kills - n_startup),
                                      args.kills - 1)
    startup_s, step_s = 8.0, 0.15  # first guesses; the attempts measure them
    run, kills = work / "run", []
    for attempt in range(args.kills + 1):
        ckpt = checkpoint_step(run)
        metrics = run / "metrics.jsonl"
        old_inode = metrics.stat().st_ino if metrics.exists() else None  # the resume rewrites the file
        log = work / f"attempt_{attempt}.log"
        resume = ["--ckpt.load_enable", "true"] if attempt else []
        t0 = time.time()
        with log.open("w") as out:
            proc = subprocess.Popen(cmd + resume, cwd=ROOT, env=ENV, start_new_session=True, stdout=out, stderr=out)
        if attempt == args.kills:
            return kills, finish(proc, log, args)
        kind = kinds[attempt]
        if kind == "start-up":
            target, delay = None, rng.uniform(1.0, startup_s)
        else:
            target, delay = min(ckpt + rng.randint(1, 2), args.steps), rng.uniform(0.0, step_s)
        try:
            row_times = wait(proc, t0, target, delay, metrics, old_inode, args.attempt_timeout)
        except BaseException:
            kill_tree(proc)
            raise
        if proc.poll() is not None:  # the attempt finished (or failed) before its kill came
            return kills, finish(proc, log, args)
        snapshot = kill_tree(proc)
        at = time.time() - t0
        if at >= args.attempt_timeout:
            return kills, [f"attempt {attempt} did not reach its kill moment in {args.attempt_timeout} s (see {log})"]
        rows = fresh_steps(metrics, old_inode)
        if row_times:
            startup_s = max(2.0, row_times[0])  # start-up kills stay within start-up
        if gaps := [b - a for a, b in zip(row_times, row_times[1:]) if b > a]:  # rows restored at once: 0
            step_s = statistics.median(gaps)
        phase = phase_guess(run, log, rows, t0, args.steps)
        kills.append(Kill(attempt, kind, at, rows[-1] if rows else 0, ckpt, phase))
        if survivors := leftovers(proc.pid, snapshot):
            return kills, survivors
    return kills, []


def wait(proc: subprocess.Popen, t0: float, target: int | None, delay: float, metrics: Path,
         old_inode: int | None, timeout: float) -> list[float]:
    """Poll until the kill moment: ``delay`` s after the launch (``target`` None) or after this attempt
    logged step ``target``; or until the attempt exits or ``timeout``. Returns when each fresh metrics
    row appeared (seconds after the launch)."""
    row_times: list[float] = []
    reached = None  # when step `target` was logged
    while proc.poll() is None and (now := time.time() - t0) < timeout:
        rows = fresh_steps(metrics, old_inode)
        row_times += [now] * (len(rows) - len(row_times))
        if target is not None and reached is None and rows and rows[-1] >= target:
            reached = now
        if now >= (delay if target is None else math.inf if reached is None else reached + delay):
            break
        time.sleep(0.01)
    return row_times


def finish(proc: subprocess.Popen, log: Path, args) -> list[str]:
    """Wait for an attempt that is not killed; failures if it fails, hangs or leaves a process behind."""
    try:
        rc = proc.wait(timeout=args.attempt_timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return [f"the last attempt did not finish in {args.attempt_timeout} s (see {log})"]
    return ([f"the last attempt exited with {rc} (see {log})"] if rc else []) + leftovers(proc.pid)


def checkpoint_step(run: Path) -> int:
    """The newest complete checkpoint's step (0: none); `checkpoint.latest` may still skip it if damaged."""
    root = run / "checkpoints"
    steps = [int(m.group(1)) for d in os.listdir(root) if (m := re.match(r"^step_(\d+)$", d))] if root.is_dir() else []
    return max(steps, default=0)


def fresh_steps(metrics: Path, old_inode: int | None) -> list[int]:
    """Steps of the complete rows this attempt's metrics file holds; [] before the attempt rewrote it."""
    try:
        if metrics.stat().st_ino == old_inode:
            return []
        lines = metrics.read_text().split("\n")
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in lines[:-1]]  # the last piece: "" or a torn row


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the attempt's process group, then every descendant or member of its session that is not
    in it (Ray starts each worker in a process group of its own); returns those pids."""
    family = descendants(proc.pid) + [pid for pid, _, sid in processes() if sid == proc.pid]
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    return family


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid, _ in processes():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def processes() -> list[tuple[int, int, int]]:
    """(pid, ppid, session id) of every live process."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z":
            out.append((int(entry), int(fields[1]), int(fields[3])))
    return out


def leftovers(session: int, snapshot: list[int] = ()) -> list[str]:
    """A failure line for each process of the attempt (its session, or its tree at the kill) still
    alive after a few seconds: Ray's own processes may take a moment to exit after a clean finish."""
    deadline = time.time() + 10
    while alive := [pid for pid, _, sid in processes() if sid == session or pid in snapshot]:
        if time.time() > deadline:
            return [f"process {pid} of attempt session {session} survived: {cmdline(pid)}" for pid in alive]
        time.sleep(0.2)
    return []


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:100]
    except FileNotFoundError:
        return "(exited)"


def phase_guess(run: Path, log: Path, rows: list[int], t0: float, steps: int) -> str:
    """What the attempt was doing at the kill, from what it left: the files are frozen once it is dead."""
    if not rows:
        if "rollout engine" not in log.read_text(errors="replace"):
            return "start-up: Ray starting"
        return "start-up: actors, checkpoint restore, first generation"
    metrics, last, saved = run / "metrics.jsonl", rows[-1], checkpoint_step(run)
    if not metrics.read_text().endswith("\n"):
        return f"writing the metrics row of step {last + 1} (torn line)"
    saving = [d.name for d in (run / "checkpoints").glob("step_*.tmp") if d.stat().st_mtime >= t0]
    if saving:
        return f"saving checkpoint {saving[0]} (partial directory left)"
    if last > saved:
        return f"step {last} logged, its checkpoint not yet written"
    if last == steps:
        return "final HF export / shutdown"
    return f"step {last + 1}: generation / training / weight sync"


def verify(run: Path, args) -> list[str]:
    """The ledger, metrics and exports of the finished run; returns the failures."""
    fails = []
    steps = [row["step"] for row in read_rows(run / "metrics.jsonl", fails)]
    if steps != list(range(1, args.steps + 1)):
        fails.append(f"metrics.jsonl steps are {steps}, expected 1..{args.steps} once each in order")
    ledger = read_rows(run / "ledger.jsonl", fails)
    trained = [(r["epoch"], r["prompt_index"]) for r in ledger if r["outcome"] == "trained"]
    twice = sorted(k for k, n in Counter(trained).items() if n > 1)
    if twice:
        fails.append(f"(epoch, prompt_index) trained more than once: {twice}")
    if len(trained) != args.steps * args.batch_size:
        fails.append(f"{len(trained)} prompts trained, expected {args.steps} steps x {args.batch_size}")
    per_step = Counter(r["step"] for r in ledger if r["outcome"] == "trained")
    if any(per_step[s] != args.batch_size for s in range(1, args.steps + 1)):
        fails.append(f"trained rows per step {dict(sorted(per_step.items()))}, expected {args.batch_size} each")
    done = {(r["epoch"], r["prompt_index"]) for r in ledger}  # trained or filtered
    last_epoch = max((e for e, _ in done), default=0)
    # The prompts still in flight when the run ended are untrained: they may span the last few epochs
    for epoch in range(last_epoch - math.ceil(IN_FLIGHT / args.prompts)):
        if missing := sorted(set(range(args.prompts)) - {i for e, i in done if e == epoch}):
            fails.append(f"epoch {epoch}: prompts {missing} were never trained (lost)")
    filtered = sum(r["outcome"] == "filtered" for r in ledger)
    print(f"ledger: {len(trained)} trained ({len(set(trained))} distinct (epoch, prompt)), {filtered} filtered, "
          f"epochs 0..{last_epoch}: {dict(sorted(Counter(e for e, _ in trained).items()))}")
    for path in (run / f"checkpoints/step_{args.steps}/meta.pt", run / "hf/model.safetensors"):
        if not path.exists():
            fails.append(f"{path} is missing")
    return fails


def read_rows(path: Path, fails: list[str]) -> list[dict]:
    """The JSON rows of a run file; a missing file or a line that does not parse is a failure."""
    if not path.exists():
        fails.append(f"{path} is missing")
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            fails.append(f"{path}:{n} is not a JSON row: {line[:80]!r}")
    return rows


def print_table(kills: list[Kill]) -> None:
    print(f"{'kill':>4} {'kind':<8} {'at (s)':>7} {'resumed from':>12} {'step seen':>9}  phase guess")
    for k in kills:
        print(f"{k.attempt + 1:>4} {k.kind:<8} {k.at_s:>7.2f} {k.ckpt_before:>12} {k.step_seen:>9}  {k.phase}")


if __name__ == "__main__":
    sys.exit(main())

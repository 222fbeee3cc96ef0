"""The whole RL loop on one GPU, as `bash bench/gpu_rl.sh run OUT` runs it once the wheels are installed:

1. gpu_check's quick checks (the machine, and instar's packed attention on CUDA);
2. a random-init model of Qwen3-0.6B's layers (`instar tiny-model` at that shape) and the calculator task's data;
3. `instar rl` with the calculator Env, the embedded engine and the trainer colocated on the one GPU, both in
   bf16 (trainer: --fsdp.mixed_precision bfloat16, engine: --engine.dtype bfloat16), strictly on-policy
   (--train.force_sync_mode), so each step's vllm_kl compares the engine with the trainer on the same weights;
4. a short float32 run of both sides: its first vllm_kl (< 1e-3) is the reference the bf16 one is read against;
5. PASS/FAIL lines from the runs' metrics.jsonl and logs, and each process's peak GPU memory, sampled from
   nvidia-smi while the runs go (what the driver reports per process: the caching allocator's reserve and the
   CUDA context, not only allocated tensors).

``--cpu-smoke``: the same on CPU at tiny sizes and few steps, here, before GPU time is spent.
Every phase runs in its own process under its own time limit; the logs go to OUT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Qwen3-0.6B's layers; the vocabulary is the tiny tokenizer's (a few hundred tokens, not 151,936): a model whose
# vocabulary exceeds its tokenizer's would sample ids no tokenizer can decode for the calculator Env
QWEN3_06B = ["--layers", "28", "--hidden", "1024", "--heads", "16", "--kv_heads", "8", "--head_dim", "128",
             "--intermediate", "3072"]
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, for the trainer's MFU
BF16_KL_BOUND = 1e-2  # the bf16 run's first vllm_kl, once the float32 run's is below 1e-3


def line(status: str, name: str, detail: str) -> None:
    print(f"{status} {name}: {detail}", flush=True)


def run(name: str, cmd: list[str], out: Path, limit: float, env: dict | None = None) -> bool:
    """``cmd`` with its output in OUT/<name>.log; True when it exits 0 within ``limit`` seconds."""
    start = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=REPO,
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = None
    took = time.monotonic() - start
    if rc != 0:
        tail = (out / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        line("FAIL", name, f"{'timed out' if rc is None else f'exit {rc}'} after {took:.0f} s; last lines: {tail}")
    print(f"TIMING {name}\t{took:.1f} s", flush=True)
    return rc == 0


class GpuMemory:
    """Peak memory of each process on the GPU, by its name (Ray names its actors' processes), from nvidia-smi."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while not self._stop.wait(0.5):
            try:
                rows = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout.splitlines()
            except (OSError, subprocess.TimeoutExpired):
                return
            for row in rows:
                pid, mib = (part.strip() for part in row.split(","))
                name = process_name(pid)
                self.peaks[name] = max(self.peaks.get(name, 0), int(mib))


def process_name(pid: str) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().split()
    except OSError:
        return f"pid {pid}"
    ray = next((w for w in words if w.startswith("ray::")), None)  # ray::EngineActor, ray::TrainWorker...
    return ray.split(".")[0] if ray else " ".join(words[:3])


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(r) for r in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "actor/loss" in r]  # training steps (not eval rows)


def median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows[1:] or rows if key in r]  # the first step warms up
    return statistics.median(values) if values else float("nan")


def rl_command(args: argparse.Namespace, model: Path, data: Path, run_dir: Path, dtype: str, steps: int) -> list[str]:
    cmd = [sys.executable, "-m", "instar", "rl", "--config", "examples/calculator/rl.yaml",
           "--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data / "train.jsonl"),
           "--ckpt.output_dir", str(run_dir), "--ckpt.overwrite", "true", "--train.max_steps", str(steps),
           "--train.force_sync_mode", "true", "--cpu.enable", "false", "--ray.placement", "colocated",
           "--engine.dtype", dtype, "--fsdp.mixed_precision", dtype]
    if args.cpu_smoke:
        cmd += ["--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--data.max_new_tokens", "16"]
    return cmd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="folder for the logs and runs")
    parser.add_argument("--cpu-smoke", action="store_true", help="on CPU at tiny sizes (a dry run here)")
    parser.add_argument("--steps", type=int, default=12, help="steps of the bf16 run")
    parser.add_argument("--checks", default="env,packed_attention_cuda", help="gpu_check's checks to run first")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = 3 if args.cpu_smoke else args.steps
    smoke = ["--cpu-smoke"] if args.cpu_smoke else []
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    os.environ.update(env)  # Ray's workers inherit it: they import this checkout's instar

    if args.checks:
        run("gpu_check", [sys.executable, "bench/gpu_check.py", *smoke, "--only", args.checks, "--budget", "100",
                          "--log", str(out / "gpu_check_full.log")], out, 120)
        print((out / "gpu_check.log").read_text(), end="", flush=True)

    model, data = out / "model", out / "data"
    shape = [] if args.cpu_smoke else QWEN3_06B
    if not (run("model", [sys.executable, "-m", "instar", "tiny-model", "--out", str(model), *shape], out, 120)
            and run("data", [sys.executable, "examples/calculator/task.py", str(data)], out, 60)):
        return
    with GpuMemory() as memory:
        bf16_ok = run("rl_bf16", rl_command(args, model, data, out / "rl_bf16", "bfloat16", steps), out,
                      120 if args.cpu_smoke else 170)
    fp32_ok = run("rl_fp32", rl_command(args, model, data, out / "rl_fp32", "float32", 2), out,
                  90 if args.cpu_smoke else 100)
    report(args, out, steps, bf16_ok, fp32_ok, memory.peaks, model)


def report(args: argparse.Namespace, out: Path, steps: int, bf16_ok: bool, fp32_ok: bool, peaks: dict[str, int],
           model: Path) -> None:
    bf16, fp32 = metrics(out / "rl_bf16"), metrics(out / "rl_fp32")
    line("PASS" if bf16_ok and len(bf16) == steps else "FAIL", "steps", f"{len(bf16)} of {steps} bf16 steps logged")
    ref = fp32[0]["actor/vllm_kl"] if fp32 else float("nan")
    line("PASS" if abs(ref) < 1e-3 else "FAIL", "vllm_kl_fp32", f"first on-policy step {ref:.2e} (bound 1e-3)")
    if bf16:  # bf16 rounds the engine's and the trainer's logits apart; the float32 run shows the code agrees
        kl = bf16[0]["actor/vllm_kl"]
        line("PASS" if abs(kl) < BF16_KL_BOUND and abs(ref) < 1e-3 else "FAIL", "vllm_kl_bf16",
             f"first on-policy step {kl:.2e} (bound {BF16_KL_BOUND:.0e}, given the float32 run's {ref:.1e} < 1e-3)")
    log = (out / "rl_bf16.log").read_text(errors="replace") if (out / "rl_bf16.log").exists() else ""
    ipc = "weights by ipc" in log and "no CUDA IPC here" not in log
    gbps = median(bf16, "weight_sync/mb_per_s") / 1024
    line("PASS" if ipc or args.cpu_smoke else "FAIL", "weight_sync",
         f"{'CUDA IPC' if ipc else 'not by CUDA IPC'}, {gbps:.2f} GB/s, {median(bf16, 'time/weight_sync'):.3f} s")
    if not bf16:
        return
    split = {k: median(bf16, f"time/{k}") for k in ("trainer_idle", "logprobs", "train", "weight_sync", "step")}
    line("INFO", "step_split", f"generation {split['trainer_idle']:.2f} s, logprobs {split['logprobs']:.2f} s, "
         f"update {split['train']:.2f} s, sync {split['weight_sync']:.2f} s, step {split['step']:.2f} s "
         f"(medians after the first step; {bf16[0].get('trajectories', 0):.0f} rollouts a step)")
    tokens = median(bf16, "tokens_per_second") * split["step"]  # every token of a step's rows
    sampled = median(bf16, "trajectories") * median(bf16, "response_length")
    line("INFO", "throughput", f"engine {sampled / split['trainer_idle']:.0f} sampled tokens/s, trainer "
         f"{tokens / split['train']:.0f} tokens/s in the update")
    params = parameter_count(model)
    name = gpu_name()
    peak = next((f for key, f in PEAK_BF16_FLOPS.items() if key in name), None)
    mfu = 6 * params * tokens / split["train"] / peak if peak else float("nan")
    line("INFO", "mfu", f"trainer update {mfu:.1%} of {name}'s dense bf16 peak (6 x {params / 1e6:.0f}M params x "
         "tokens / update time)" if peak else f"no bf16 peak known for {name!r}")
    line("INFO", "gpu_memory", ", ".join(f"{k} {v / 1024:.1f} GiB" for k, v in sorted(peaks.items()))
         or "no nvidia-smi readings")


def parameter_count(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in model.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


if __name__ == "__main__":
    main()

"""One trainer rank's policy update on its own, at `bench/rl_step.py`'s shapes: the demo-shaped model
(4 layers, hidden 128), 8 groups of 8 samples, each group one 36-token prompt (laid out once per
micro-batch, `--train.share_prefix`, as in the loop; `--no-share-prefix`: every sample whole) and 30-48
sampled tokens, GRPO advantages of +-1 with one group at zero (run forward only). With the CPU accelerator
(`--cpu.enable`), eager layers against `--fsdp.compile`, each in a fresh process (an inductor cache from an
earlier run makes its first step seconds instead of ~20 s), alternating --repeats times; medians of --updates
timed updates after three untimed ones. `--profile` prints the eager update's op table instead (what the closing notes'
profiles are). The last line is `compile_ratio=<eager / compiled update time>`.

    OMP_NUM_THREADS=1 python bench/update.py [--threads 1] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch


def update_times(model_dir: str, compile: bool, threads: int, updates: int, profile: bool, share: bool,
                 ) -> list[float]:
    from instar.config import ActorConfig, CpuConfig, FSDPConfig, RLConfig, TrainConfig
    from instar.contract import Sample
    from instar.runtime.batching import rl_loss
    from instar.train.batch import StepInputs
    from instar.train.launch import reserve_port
    from instar.train.worker import TrainWorker

    torch.set_num_threads(threads)
    cfg = RLConfig()
    cfg.algo.advantage.estimator = "grpo"
    worker = TrainWorker(ActorConfig(model_name_or_path=model_dir, learning_rate=1e-4),
                         FSDPConfig(compile=compile), TrainConfig(max_steps=1000, share_prefix=share),
                         cpu=CpuConfig(enable=True))  # the CPU configuration for speed, as bench/rl_step.py's
    worker.init(0, 1, "127.0.0.1", reserve_port())
    rng, samples, advantages = random.Random(0), [], []
    for i in range(64):
        if i % 8 == 0:
            prompt = [rng.randrange(3, 500) for _ in range(36)]
        ids = prompt + [rng.randrange(3, 500) for _ in range(rng.randint(30, 48))]
        mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        samples.append(Sample(ids, mask, [-6.0 if m else 0.0 for m in mask], [0 if m else -1 for m in mask]))
        advantages.append(torch.full((len(ids),), 0.0 if i // 8 == 3 else rng.choice([-1.0, 1.0])))
    idle = [i for i, a in enumerate(advantages) if not a.any()]

    def update() -> float:
        start = time.perf_counter()
        worker.train_policy(samples, partial(rl_loss, cfg, 0.0), StepInputs(advantages=advantages), 1.0, None, idle)
        return time.perf_counter() - start

    for _ in range(3):
        update()
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            update()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return [update() for _ in range(updates)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="the rank's torch threads (1: as beside a busy engine)")
    p.add_argument("--updates", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--share-prefix", default=True, action=argparse.BooleanOptionalAction)
    p.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "COMPILE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        times = update_times(args.child[0], args.child[1] == "1", args.threads, args.updates, args.profile,
                             args.share_prefix)
        print(json.dumps(times))
        return
    from instar.data.tiny_model import TinySpec, build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        model = str(Path(d) / "model")
        build_tiny_model(Path(model), TinySpec(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256))
        if args.profile:
            update_times(model, False, args.threads, 1, True, args.share_prefix)
            return
        medians: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            for kind in medians:
                out = subprocess.run([sys.executable, __file__, "--child", model, str(int(kind == "compiled")),
                                      "--threads", str(args.threads), "--updates", str(args.updates),
                                      "--share-prefix" if args.share_prefix else "--no-share-prefix"],
                                     capture_output=True, text=True, check=True, env=os.environ)
                medians[kind].append(statistics.median(json.loads(out.stdout.strip().splitlines()[-1])))
    for kind, values in medians.items():
        print(f"{kind:9s} update {statistics.median(values) * 1000:6.1f} ms "
              f"({', '.join(f'{v * 1000:.1f}' for v in values)}; {args.threads} thread(s))")
    print(f"compile_ratio={statistics.median(medians['eager']) / statistics.median(medians['compiled']):.2f}")


if __name__ == "__main__":
    main()

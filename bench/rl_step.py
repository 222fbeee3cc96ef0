"""instar rl against a bare sequential GRPO loop: the same machine, model, prompts, reward and sampling.

The bare loop is what one would write by hand in plain PyTorch: HF `generate` (left-padded batch,
temperature 1), the reward, group-normalised advantages, one optimizer step per batch (on-policy
REINFORCE with the GRPO baseline; rows with a zero advantage, which carry no gradient, left out, as
instar does here with `--train.forward_only_rows false`; `--forward-only-rows` runs them forward for their
metrics, instar's default), every core for torch's threads. The reward is the exact answer (1) plus a
shaped part (how often the answer's digits occur, / 100): with the exact answer alone a random-init
model's groups all score 0, so every advantage would be 0 and neither side would have an update to
compute; here groups differ, as in a task the policy half solves. instar runs the real `instar rl`
topology (Ray actors, the embedded engine, the agent runner and its env loop, an FSDP2 trainer rank,
weight sync) in each mode: strictly on-policy (`--train.force_sync_mode`), async one step ahead (the
default), and async with partial rollout; each in two configurations (`--configs`): `default`, `instar rl`'s own
(plain PyTorch), and `accelerated`, instar's CPU configuration for speed: the CPU accelerator (`--cpu.enable`) and
the trainer's layers through torch.compile (`--fsdp.compile`, unless `--no-trainer-compile`); a first run builds
their kernels for ~20-30 s, the untimed first steps build or load them. `--mixed-precision bfloat16` trains both
sides in bf16 (instar's
`--fsdp.mixed_precision`, float32 master weights; the bare loop under `torch.autocast`); both generate
in float32.

Both sides count completion tokens (sampled tokens, the end-of-turn token included) per second of
the timed steps (the first --warmup steps of each are not timed); the bare loop runs before and after
instar's runs and its two figures are averaged (the speed of a shared machine drifts over minutes; on this
2-core machine the bare loop has read 5.8k to 11.4k tokens/s on different days). `--rounds N` repeats instar's
runs N times, a bare run between each two, and takes the median of the N ratios. Under each
mode: the CPU a step took over the timed steps, per role (engine, trainer, agent runner, driver, the rest of the
machine), and the ratio the same work would give with every core busy all the time, a ceiling for better
scheduling alone; then the core-seconds the step's matmuls alone would take at one core's peak (measured in
the run on a trainer-shaped product) and the ratio if that were all the step did: a ceiling for any
implementation of the same arithmetic. The last lines are `rl_ratio[<configuration>]=<instar async / bare>` (the
median over rounds), one per configuration.

    OMP_NUM_THREADS=1 python bench/rl_step.py                          # 8 prompts x 8 samples x 48 tokens
    OMP_NUM_THREADS=1 python bench/rl_step.py --prompts 32 --new-tokens 256 --scale 10   # a 10x model
    OMP_NUM_THREADS=1 python bench/rl_step.py --modes async --rounds 5    # the median of 5 rounds
    OMP_NUM_THREADS=1 python bench/rl_step.py --scale 10 --modes sync --lora-rank 16   # instar's update under LoRA
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from instar.config import RLConfig
from instar.cpu.trainer import onednn_linear, uses_onednn
from instar.data.tiny_model import TinySpec, build_tiny_model
from instar.train.model import DTYPES

AGENT = '''
from instar.agents import Env, Result, StepEnvRunner


def reward(text: str, label: str) -> float:
    return float(label in text) + sum(text.count(d) for d in set(label)) / 100


class Sum(Env):
    async def step(self, state: dict) -> Result:
        text, label = state["action_text"], state["label"]
        return Result(reward=reward(text, label), score=float(label in text))


AgentRunner = StepEnvRunner(Sum)
'''


def reward(text: str, label: str) -> float:  # the agent's, for the bare loop
    return float(label in text) + sum(text.count(d) for d in set(label)) / 100


def build(out: Path, scale: int, n_prompts: int) -> tuple[str, str, str]:
    """A random-init model (demo shape, or about `scale` times its parameters), prompts, the agent file."""
    width = {1: 128, 10: 384}[scale]
    model = build_tiny_model(out / "model", TinySpec(layers=4, hidden=width, heads=4, kv_heads=2,
                                                     intermediate=2 * width))
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i}+{2 * i + 1}?", "label": str(3 * i + 1)}) + "\n"
                               for i in range(max(64, 4 * n_prompts))))
    agent = out / "agent.py"
    agent.write_text(AGENT)
    return str(model), str(prompts), str(agent)


def bare_loop(model_dir: str, prompts_path: str, args: argparse.Namespace) -> dict[str, float]:
    """The hand-written sequential loop; returns completion tokens/s and the mean step split."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(torch.get_num_threads() if args.bare_threads == 0 else args.bare_threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    records = [json.loads(line) for line in Path(prompts_path).read_text().splitlines()]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    timed_tokens, timed_s, gen_s, train_s, idle_rows = 0, 0.0, 0.0, 0.0, 0.0
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        batch = [records[(step * args.prompts + i) % len(records)] for i in range(args.prompts)]
        prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False) for r in batch]
        prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
        prompts = [p for p in prompts for _ in range(args.samples)]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=0)
        completions = []
        for row in out[:, width:].tolist():
            completions.append(row[:row.index(eos) + 1] if eos in row else row)
        t1 = time.perf_counter()
        rewards = torch.tensor([reward(tok.decode(c), batch[i // args.samples]["label"])
                                for i, c in enumerate(completions)]).view(args.prompts, args.samples)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
        seqs = [p + c for p, c in zip(prompts, completions)]
        length = max(map(len, seqs))
        x = torch.tensor([s + [0] * (length - len(s)) for s in seqs])
        attn = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in seqs])
        act = torch.tensor([[0] * len(p) + [1] * len(c) + [0] * (length - len(p) - len(c))
                            for p, c in zip(prompts, completions)])[:, 1:].float()
        live = adv != 0
        opt.zero_grad()
        if live.any():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.mixed_precision == "bfloat16"):
                logits = model(input_ids=x[live], attention_mask=attn[live]).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1)
            logp = logp.gather(-1, x[live, 1:, None])[..., 0]
            loss = -(adv[live, None] * logp * act[live]).sum() / act.sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t2 = time.perf_counter()
        if step >= args.warmup:
            idle_rows += int((~live).sum()) / len(live)
            timed_tokens += sum(map(len, completions))
            timed_s += t2 - t0
            gen_s += t1 - t0
            train_s += t2 - t1
    return {"tokens_per_s": timed_tokens / timed_s, "step_s": timed_s / args.steps,
            "generate_s": gen_s / args.steps, "train_s": train_s / args.steps, "forward_only": idle_rows / args.steps}


def matmul_work(model_dir: str, prompts_path: str, n_prompts: int) -> tuple[int, float, int]:
    """The model's matmul weights (every linear layer and the head: 2 FLOPs each per token forward, 6 with
    the backward; attention's own products left out), the mean prompt length in tokens and the hidden width."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    records = [json.loads(line) for line in Path(prompts_path).read_text().splitlines()][:n_prompts]
    lengths = [len(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)) for r in records]
    return weights, statistics.mean(lengths), model.config.hidden_size


def matmul_peak(width: int, dtype: torch.dtype, onednn: bool = False) -> float:
    """FLOP/s of one thread on a trainer-shaped product, (3072, width) @ (width, 2 width), measured now;
    ``onednn``: through oneDNN, as instar's trainer with --cpu.matmul onednn computes it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, w = torch.randn(3072, width, dtype=dtype), torch.randn(2 * width, width, dtype=dtype)
    product = (lambda: onednn_linear(a, w)) if onednn else (lambda: a @ w.T)
    for _ in range(20):
        product()
    start, n = time.perf_counter(), 200
    for _ in range(n):
        product()
    seconds = time.perf_counter() - start
    torch.set_num_threads(threads)
    return 2 * 3072 * width * 2 * width * n / seconds


def floor_seconds(r: dict[str, float], weights: int, prompt_len: float, n_prompts: int, peaks: tuple[float, float],
                  run_idle: bool) -> tuple[float, float]:
    """Core-seconds a step's matmuls take at one core's peak: (engine, trainer). The engine computes each
    group's prompt once and every sampled token; the trainer runs the same tokens forward and backward but
    the rows with no gradient: forward only (``run_idle``) or not at all."""
    tokens = r["tokens_per_step"] + n_prompts * prompt_len
    passes = 6 * (1 - r["forward_only"]) + (2 if run_idle else 0) * r["forward_only"]
    return 2 * weights * tokens / peaks[0], passes * weights * tokens / peaks[1]


ROLES = {"ray::EngineActor": "engine", "ray::_Rank": "trainer", "ray::AgentActor": "agent"}


def cpu_seconds() -> dict[str, tuple[str, float]]:
    """Each process's title and CPU seconds so far, the whole machine's (busy: all but idle and iowait),
    and the wall clock."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[pid] = (title, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return out | {"machine": ("", (sum(cpu) - cpu[3] - cpu[4]) / tick), "wall": ("", time.perf_counter())}


def role(pid: str, title: str) -> str:
    if pid in ("machine", "wall"):
        return pid
    if int(pid) == os.getpid():
        return "driver"
    return next((r for prefix, r in ROLES.items() if title.startswith(prefix)), "other")


@contextlib.contextmanager
def cpu_window(first: int, last: int) -> Iterator[dict[str, float]]:
    """CPU seconds of each instar role (all its processes), of the machine, and the wall time between the
    loop's metrics rows of steps ``first`` and ``last`` (a row is written as its step ends), read when the
    loop logs them. A Ray worker's title names its actor (``ray::EngineActor.method``) once it holds one."""
    from instar.train import run_dir

    marks: dict[int, dict[str, tuple[str, float]]] = {}
    log = run_dir.MetricsLogger.log

    def logged(self: run_dir.MetricsLogger, step: int, metrics: dict) -> None:
        log(self, step, metrics)
        if step in (first, last):
            marks[step] = cpu_seconds()
    out: dict[str, float] = {}
    run_dir.MetricsLogger.log = logged
    try:
        yield out
    finally:
        run_dir.MetricsLogger.log = log
    if len(marks) == 2:  # a process that ended in between is left out: its last figures are unknown
        for pid, (title, seconds) in marks[last].items():
            before = marks[first].get(pid, ("", 0.0))
            key = role(pid, title)
            if key == "other":  # named by the title it had at the first read
                key = role(pid, before[0])
            out[key] = out.get(key, 0.0) + seconds - before[1]


def instar_run(model_dir: str, prompts: str, agent: str, out: Path, args: argparse.Namespace,
               config: str, mode: str) -> dict[str, float]:
    from instar.loop import run

    cfg = RLConfig()
    cfg.actor.model_name_or_path, cfg.actor.learning_rate = model_dir, args.lr
    cfg.data.prompt_dataset, cfg.data.max_new_tokens, cfg.data.max_len = prompts, args.new_tokens, 512
    cfg.train.agent_path, cfg.train.max_steps = agent, args.warmup + args.steps
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt = args.prompts, args.samples
    cfg.algo.advantage.estimator = "grpo"
    cfg.train.force_sync_mode = mode == "sync"
    cfg.train.partial_rollout_enable = mode == "partial"
    cfg.ckpt.output_dir = str(out / f"run-{config}-{mode}")
    cfg.fsdp.num_ranks = args.ranks
    accelerated = config == "accelerated"
    cfg.cpu.enable, cfg.cpu.matmul = accelerated, args.cpu_matmul
    cfg.fsdp.compile = accelerated and args.trainer_compile
    cfg.train.forward_only_rows = args.forward_only_rows
    cfg.fsdp.mixed_precision = args.mixed_precision
    cfg.actor.lora_rank, cfg.actor.lora_alpha = args.lora_rank, 2 * max(args.lora_rank, 1)
    with cpu_window(args.warmup, args.warmup + args.steps) as cpu:
        run(cfg)
    rows = [json.loads(line) for line in (out / f"run-{config}-{mode}/metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r.get("step", 0) > args.warmup and "time/step" in r]
    seconds = sum(r["time/step"] for r in timed)
    tokens = sum(r["response_length"] * r["trajectories"] for r in timed)
    split = {k: statistics.mean(r[f"time/{k}"] for r in timed)
             for k in ("trainer_idle", "logprobs", "train", "weight_sync", "step")}
    split |= {k: statistics.mean(r.get(f"weight_sync/{k}_s", 0.0) for r in timed) for k in ("engine_wait", "transfer")}
    engine = {k: statistics.mean(r.get(f"engine/{k}", 0.0) for r in timed)
              for k in ("idle_fraction", "rows_per_step", "step_ms")}
    cpu = {f"cpu_{k}": v / len(timed) for k, v in cpu.items()}  # core-seconds per timed step
    return {"tokens_per_s": tokens / seconds, "tokens_per_step": tokens / len(timed), **split, **engine, **cpu,
            "forward_only": statistics.mean(r.get("actor/forward_only", 0.0) for r in timed),
            "agent_cpu": statistics.mean(r.get("agent/cpu_fraction", 0.0) for r in timed)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--scale", type=int, default=1, choices=[1, 10], help="model size: the demo's, or ~10x")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--modes", default="sync,async,partial")
    p.add_argument("--ranks", type=int, default=1, help="instar's trainer ranks (--fsdp.num_ranks)")
    p.add_argument("--configs", default="default,accelerated",
                   help="instar's configurations: default (plain PyTorch), accelerated (--cpu.enable, --fsdp.compile)")
    p.add_argument("--trainer-compile", default=True, action=argparse.BooleanOptionalAction,
                   help="accelerated: with --fsdp.compile (the trainer's dense layers through torch.compile)")
    p.add_argument("--forward-only-rows", default=False, action=argparse.BooleanOptionalAction,
                   help="instar's --train.forward_only_rows (run the rows with no gradient forward, for metrics)")
    p.add_argument("--cpu-matmul", default="auto", choices=["auto", "onednn", "blas"],
                   help="accelerated: --cpu.matmul (the trainer's float32 linear layers through oneDNN or the BLAS)")
    p.add_argument("--mixed-precision", default="float32", choices=["float32", "bfloat16"],
                   help="the training compute dtype: instar's --fsdp.mixed_precision, autocast in the bare loop")
    p.add_argument("--lora-rank", type=int, default=0, help="instar trains LoRA adapters of this rank "
                   "(--actor.lora_rank; the bare loop still trains every weight)")
    p.add_argument("--bare-threads", type=int, default=2, help="torch threads of the bare loop (0: torch's default)")
    p.add_argument("--rounds", type=int, default=1, help="instar's runs this many times, each between two runs of "
                   "the bare loop; rl_ratio: the median of the rounds' ratios (the details printed: the last round)")
    args = p.parse_args()
    configs, modes = args.configs.split(","), args.modes.split(",")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        model_dir, prompts, agent = build(out, args.scale, args.prompts)
        weights, prompt_len, width = matmul_work(model_dir, prompts, args.prompts)
        peaks = {}
        for config in configs:  # the trainer's products as each configuration computes them
            onednn = config == "accelerated" and args.mixed_precision == "float32" and uses_onednn(args.cpu_matmul)
            peaks[config] = (matmul_peak(width, torch.float32),
                             matmul_peak(width, DTYPES[args.mixed_precision], onednn), onednn)
        # the bare loop before and after each round of instar's runs, averaged: the machine's speed drifts
        bares, rounds = [bare_loop(model_dir, prompts, args)], []
        for r in range(args.rounds):
            rounds.append({(config, mode): instar_run(model_dir, prompts, agent, out / f"round-{r}", args, config, mode)
                           for config in configs for mode in modes})
            bares.append(bare_loop(model_dir, prompts, args))
        before, after = bares[-2], bares[-1]  # the lines below: the last round
        bare = {k: (before[k] + after[k]) / 2 for k in before}
    print(f"\nworkload: {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, "
          f"model scale {args.scale}, {args.steps} timed steps after {args.warmup}; instar configurations: "
          + "; ".join(CONFIGS[c].format(compile=str(args.trainer_compile).lower(), matmul=args.cpu_matmul)
                      for c in configs)
          + f"; --train.forward_only_rows {str(args.forward_only_rows).lower()}; training in {args.mixed_precision}")
    print(f"bare loop: {bare['tokens_per_s']:8.0f} completion tokens/s, step {bare['step_s']:.3f} s "
          f"(generate {bare['generate_s']:.3f} s, train {bare['train_s']:.3f} s, {args.bare_threads} threads, "
          f"rows with no advantage {bare['forward_only']:.0%}; "
          f"{before['tokens_per_s']:.0f} before instar's runs, {after['tokens_per_s']:.0f} after)")
    for config in configs:
        report({mode: rounds[-1][config, mode] for mode in modes}, bare, config, peaks[config], weights, prompt_len,
               args)
    for config in configs:
        main_mode = "async" if "async" in modes else modes[0]
        around = [(b0["tokens_per_s"] + b1["tokens_per_s"]) / 2 for b0, b1 in zip(bares, bares[1:])]
        ratios = [run[config, main_mode]["tokens_per_s"] / b for run, b in zip(rounds, around)]
        if len(ratios) > 1:
            print(f"{config} {main_mode} by round (bare loop around it): " + ", ".join(
                f"{run[config, main_mode]['tokens_per_s']:.0f} / {b:.0f} = {q:.2f}"
                for run, b, q in zip(rounds, around, ratios)))
        print(f"rl_ratio[{config}]={statistics.median(ratios):.2f}")


CONFIGS = {"default": "default (plain PyTorch, as `instar rl` runs unless told otherwise)",
           "accelerated": "accelerated (--cpu.enable true --cpu.matmul {matmul} --fsdp.compile {compile})"}


def report(results: dict[str, dict[str, float]], bare: dict[str, float], config: str,
           peaks: tuple[float, float, bool], weights: int, prompt_len: float, args: argparse.Namespace) -> None:
    """The lines of one configuration's runs: each mode's figures and ceilings, then its mode ratios."""
    for mode, r in results.items():
        ratio = r["tokens_per_s"] / bare["tokens_per_s"]
        print(f"instar {config} {mode:8s} {r['tokens_per_s']:8.0f} completion tokens/s, ratio {ratio:.2f}"
              f"; step {r['step']:.3f} s = waiting for rollouts {r['trainer_idle']:.3f} + logprobs {r['logprobs']:.3f}"
              f" + update {r['train']:.3f} + weight sync {r['weight_sync']:.3f} (transfer {r['transfer']:.3f}, of"
              f" it waiting for the engine's loop {r['engine_wait']:.3f}); engine idle {r['idle_fraction']:.0%}, "
              f"{r['rows_per_step']:.0f} rows and {r['step_ms']:.1f} ms a step; "
              f"agent runner CPU {r['agent_cpu']:.0%}; rows with no gradient {r['forward_only']:.0%} "
              f"({'run forward only' if args.forward_only_rows else 'left out'})")
        if "cpu_machine" in r:  # a ceiling: the same work with every core busy all the time
            cores = os.cpu_count() or 1  # what /proc/stat's busy time is of
            packed = r["cpu_machine"] / cores
            roles = " + ".join(f"{k} {r.get('cpu_' + k, 0.0):.3f}" for k in (*ROLES.values(), "driver", "other"))
            print(f"  core-seconds a step: {roles}; the machine {r['cpu_machine']:.3f} of {cores} x {r['cpu_wall']:.3f}"
                  f" ({r['cpu_machine'] / cores / r['cpu_wall']:.0%} busy): with every core busy this work takes "
                  f"{packed:.3f} s a step, ratio {ratio * r['cpu_wall'] / packed:.2f}")
            engine, trainer = floor_seconds(r, weights, prompt_len, args.prompts, peaks[:2], args.forward_only_rows)
            kind = "oneDNN" if peaks[2] else "" if args.mixed_precision == "float32" else "bf16"
            trained = f", the trainer's {peaks[1] / 1e9:.0f} in {kind}" if kind else ""
            print(f"  the matmuls alone at one core's peak ({peaks[0] / 1e9:.0f} GFLOP/s in float32{trained}, measured "
                  f"now): engine {engine:.3f} + trainer {trainer:.3f} core-seconds a "
                  f"step, {(engine + trainer) / r['cpu_machine']:.0%} of the machine's; with nothing else and every "
                  f"core busy, ratio {ratio * r['cpu_wall'] / ((engine + trainer) / cores):.2f}")
    if "sync" in results and "async" in results:
        print(f"{config} async_over_sync={results['async']['tokens_per_s'] / results['sync']['tokens_per_s']:.2f}")
    if "partial" in results and "async" in results:
        partial = results["partial"]["tokens_per_s"] / results["async"]["tokens_per_s"]
        print(f"{config} partial_over_async={partial:.2f}")


if __name__ == "__main__":
    main()

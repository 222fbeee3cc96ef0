"""Smoke test of the vLLM engine on a GPU machine: the checks of the vLLM test tier (tests/vllm, which CI
runs on vLLM's CPU build) on a real accelerator, in a few minutes, plus start-up time and throughput.

Builds the tiny models offline, then checks, against HF transformers in float32:
  logprobs     greedy and sampled logprobs agree (tolerance 0.02 in bfloat16, 1e-3 in float32)
  partial      pause("keep") -> update_weights (tied head, no lm_head.weight sent) -> resume mid-request:
               versions split once, tokens after the swap carry the new model's logprobs
  broadcast    the trainer's weight-sync group straight into vLLM's worker (NCCL with 2+ GPUs, else gloo)
  sleep        (GPU) before the broadcast the engine sleeps (--engine.enable_sleep_mode): GPU memory freed;
               the broadcast wakes it, and its check then runs on the woken engine
  routing      (GPU) routed experts per sampled token from the tiny MoE match the HF router
  throughput   bench/engine.py's two workloads (64 prompts x 64 tokens; 64 sessions x 4 turns), tokens/s

    python bench/vllm_smoke.py [--dtype bfloat16] [--no-eager] [--embedded] [--repeats 2]

Exits non-zero if a check fails. The last line is `smoke: <passed> ok, <failed> failed`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from instar.config import EngineConfig
from instar.contract import SamplingParams
from instar.data.tiny_model import TinySpec, build_tiny_model
from instar.engines.vllm import VLLMEngine
from instar.train.launch import reserve_port
from instar.train.weight_sync import open_sync_group, receive_weights, send_weights

sys.path.insert(0, str(Path(__file__).parent))
from engine import SESSIONS, engine_agent, engine_batch, workload  # noqa: E402  (bench/engine.py)

PROMPTS = [[5, 77, 301], [12, 400, 9, 250, 33, 71, 2, 18, 90, 91, 92, 300, 301, 302, 17, 16, 15],
           [260, 261, 262, 263, 264, 265, 266, 267, 268], [100 + i for i in range(30)]]
results: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str) -> None:
    results.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(model, prompt, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def max_gap(model, prompt, gen) -> float:
    return (torch.tensor(gen.logprobs) - hf_logprobs(model, prompt, gen.token_ids)).abs().max().item()


async def check_logprobs(engine, a, tol):
    for name, params in (("greedy", SamplingParams(temperature=0, max_tokens=16)),
                         ("sampled", SamplingParams(temperature=1.0, max_tokens=16, seed=3))):
        gens = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
        gap = max(max_gap(a, p, g) for p, g in zip(PROMPTS, gens))
        report(f"logprobs/{name}", gap < tol, f"max |vllm - hf fp32| = {gap:.2e} (tolerance {tol})")


async def check_partial(engine, a, b, tol):
    prompt = PROMPTS[1]
    task = asyncio.create_task(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1000)))
    while engine.load().running == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    await engine.pause("keep")
    await engine.update_weights(b.named_parameters(), version=1)  # tied: no lm_head.weight
    await engine.resume()
    gen = await task
    k = gen.versions.count(0)
    split = gen.versions == [0] * k + [1] * (len(gen.versions) - k) and 0 < k < len(gen.versions)
    got = torch.tensor(gen.logprobs)
    before = (got[:k] - hf_logprobs(a, prompt, gen.token_ids[:k])).abs().max().item() if k else float("nan")
    after = (got[k:] - hf_logprobs(b, prompt, gen.token_ids)[k:]).abs().max().item() if split else float("nan")
    report("partial", split and before < tol and after < tol and len(gen.token_ids) == 1000,
           f"{k} tokens at version 0, {len(gen.token_ids) - k} at 1; max gap before {before:.2e}, after {after:.2e}")
    await engine.pause("keep")
    await engine.update_weights(a.named_parameters(), version=2)
    await engine.resume()


async def check_broadcast(engine, b, tol, tp):
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"  # NCCL refuses two ranks on one GPU
    if device == "cuda":
        torch.cuda.set_device(torch.cuda.device_count() - 1)  # the trainer side; vLLM holds GPU 0
    port = reserve_port()
    box: dict = {}
    opener = threading.Thread(target=lambda: box.update(group=open_sync_group("127.0.0.1", port, 0, 1 + tp,
                                                                             device=device)))
    opener.start()
    await engine.join_weight_group(open_sync_group, "127.0.0.1", port, first_rank=1, world_size=1 + tp, device=device)
    opener.join()
    model = b.to(device)
    if engine.cfg.enable_sleep_mode:  # as while the trainer runs; receive_weights wakes it
        free = torch.cuda.mem_get_info(0)[0]
        await engine.sleep()
        freed = (torch.cuda.mem_get_info(0)[0] - free) / 2**20
        report("sleep", freed > 0, f"vLLM's sleep level 1 freed {freed:.0f} MiB of GPU 0")
    sender = threading.Thread(target=lambda: box.update(stats=send_weights(model.named_parameters(), box["group"])))
    await engine.pause("keep")
    sender.start()
    await engine.receive_weights(receive_weights, version=3)
    sender.join()
    await engine.resume()
    b.to("cpu")
    gen = await engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16))
    gap = max_gap(b, PROMPTS[0], gen)
    report("broadcast", gap < tol and gen.versions == [3] * 16,
           f"{device} group, {box['stats']['weight_sync/mb_per_s']:.0f} MB/s; max gap to the sent model {gap:.2e}")


async def check_routing(moe_dir, cfg):
    try:
        engine = VLLMEngine.from_pretrained(moe_dir, cfg, routing_replay=True)
    except Exception as error:  # a missing feature is a failed check, not a crash of the smoke run
        report("routing", False, f"start-up failed: {error!r}")
        return
    try:
        moe = hf(moe_dir)
        gens = await asyncio.gather(*(engine.generate(p, SamplingParams(temperature=1.0, max_tokens=8, seed=0))
                                      for p in PROMPTS))
        agree = total = 0
        for prompt, gen in zip(PROMPTS, gens):
            recorded = []
            hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out, rec=recorded: rec.append(out[2]))
                     for layer in moe.model.layers]
            try:
                hf_logprobs(moe, prompt, gen.token_ids)
            finally:
                for h in hooks:
                    h.remove()
            expected = torch.stack(recorded, dim=1)[len(prompt):len(prompt) + 7]  # the last token is never fed
            got = gen.routed_experts
            assert got.shape == (8, len(moe.model.layers), moe.config.num_experts_per_tok), got.shape
            agree += (got[:7].sort(-1).values == expected.sort(-1).values).all(-1).sum().item()
            total += expected.shape[0] * expected.shape[1]
        report("routing", agree / total >= 0.9, f"{agree}/{total} (token, layer) expert sets equal the HF router's")
    except Exception as error:
        report("routing", False, repr(error))
    finally:
        await engine.close()


async def throughput(engine, vocab, repeats: int) -> dict[str, float]:
    """Best tokens/s of ``repeats`` runs of each workload, as bench/engine.py measures it."""
    prompts, budgets, observations = workload(vocab)
    await engine_batch(engine, prompts[:4])  # warm-up
    rates = {}
    for name, run in (("batch", lambda: engine_batch(engine, prompts)),
                      ("agent", lambda: engine_agent(engine, prompts, budgets, observations))):
        for _ in range(repeats):
            start = time.perf_counter()
            tokens = await run()
            rates[name] = max(rates.get(name, 0.0), tokens / (time.perf_counter() - start))
    return rates


async def main(args) -> None:
    gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    tol = 0.02 if dtype != "float32" else 1e-3
    root = Path(tempfile.mkdtemp(prefix="instar-vllm-smoke-"))
    a_dir, b_dir = build_tiny_model(root / "a"), build_tiny_model(root / "b", TinySpec(seed=1))
    a, b = hf(a_dir), hf(b_dir)
    cfg = EngineConfig(dtype=dtype, enforce_eager=not args.no_eager, max_num_seqs=SESSIONS,
                       gpu_memory_utilization=0.3, enable_sleep_mode=gpu)
    start = time.perf_counter()
    engine = VLLMEngine.from_pretrained(a_dir, cfg)
    print(f"start-up: {time.perf_counter() - start:.1f} s ({'GPU' if gpu else 'CPU'}, {dtype})", flush=True)
    try:
        await check_logprobs(engine, a, tol)
        await check_partial(engine, a, b, tol)
        await check_broadcast(engine, b, tol, cfg.tensor_parallel_size)
        rates = await throughput(engine, a.config.vocab_size, args.repeats)
    finally:
        await engine.close()
    if gpu:
        await check_routing(build_tiny_model(root / "moe", TinySpec(moe=True)), cfg)
    if args.embedded:
        from instar.engines import EmbeddedEngine
        embedded = EmbeddedEngine(a, EngineConfig(max_num_seqs=SESSIONS))
        try:
            base = await throughput(embedded, a.config.vocab_size, args.repeats)
        finally:
            await embedded.close()
    for name in ("batch", "agent"):
        extra = f", embedded {base[name]:.0f} tok/s" if args.embedded else ""
        print(f"throughput {name}: vllm {rates[name]:.0f} tok/s{extra}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on GPU")
    parser.add_argument("--no-eager", action="store_true", help="let vLLM compile, capture CUDA graphs")
    parser.add_argument("--embedded", action="store_true", help="also measure the embedded engine's throughput")
    parser.add_argument("--repeats", type=int, default=2, help="throughput: best of this many runs per workload")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    asyncio.run(main(parser.parse_args()))
    failed = sum(not ok for _, ok, _ in results)
    print(f"smoke: {len(results) - failed} ok, {failed} failed")
    sys.exit(1 if failed else 0)

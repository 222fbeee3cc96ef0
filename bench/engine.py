"""Throughput of the embedded engine against HF `generate` on the tiny model, measured in one run.

(a) batch: 64 prompts (16-48 tokens) x 64 sampled tokens; baseline: one batched, left-padded HF
    `generate` call.
(b) agent: 64 sessions x 4 turns. Each turn samples a per-(session, turn) number of tokens between 8
    and 64 (agent turns differ in length), then an 8-token observation is appended and the session's
    next turn is sent as soon as its previous one returns. Baseline: HF `generate` batched per turn:
    every turn waits for the longest one (max_new_tokens = the turn's longest budget, each session
    keeps only its own budget) and re-encodes the whole history.

Both sides sample at temperature 1 with no stop tokens, so they produce exactly the same number of
tokens; tokens/s counts only the tokens each session keeps. Each figure is the median of --repeats runs, the
four measurements interleaved so that a burst of load from other processes hits both sides alike.
The last two lines are `batch_ratio=<x>` and `agent_ratio=<y>`.

    OMP_NUM_THREADS=1 python bench/engine.py [--model-dir DIR] [--accelerated]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import statistics
import tempfile
import time
import uuid

import torch

from instar.config import EngineConfig
from instar.contract import SamplingParams
from instar.engines import EmbeddedEngine

SESSIONS, TURNS, NEW_TOKENS, OBSERVATION = 64, 4, 64, 8


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Sampled continuations of ``prompts`` from one left-padded HF ``generate`` call."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    return out[:, width:].tolist()


def workload(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 48))] for _ in range(SESSIONS)]
    budgets = [[rng.randint(8, 64) for _ in range(TURNS)] for _ in range(SESSIONS)]
    observations = [[[rng.randrange(vocab) for _ in range(OBSERVATION)] for _ in range(TURNS)] for _ in range(SESSIONS)]
    return prompts, budgets, observations


def hf_batch(model, prompts) -> int:
    return sum(len(t) for t in hf_generate(model, prompts, NEW_TOKENS))


def hf_agent(model, prompts, budgets, observations) -> int:
    histories, kept = [list(p) for p in prompts], 0
    for turn in range(TURNS):
        outs = hf_generate(model, histories, max(b[turn] for b in budgets))
        for s, out in enumerate(outs):
            tokens = out[: budgets[s][turn]]
            kept += len(tokens)
            histories[s] += tokens + observations[s][turn]
    return kept


async def engine_batch(engine, prompts) -> int:
    params = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS)
    gens = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return sum(len(g.token_ids) for g in gens)


async def engine_agent(engine, prompts, budgets, observations) -> int:
    run = uuid.uuid4().hex  # fresh session ids: no prefix cached by an earlier repeat

    async def session(s: int) -> int:
        history, kept = list(prompts[s]), 0
        for turn in range(TURNS):
            gen = await engine.generate(history, SamplingParams(temperature=1.0, max_tokens=budgets[s][turn]),
                                        session_id=f"{run}-{s}")
            kept += len(gen.token_ids)
            history += gen.token_ids + observations[s][turn]
        return kept

    return sum(await asyncio.gather(*(session(s) for s in range(SESSIONS))))


def rate(run) -> float:
    start = time.perf_counter()
    tokens = run()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", help="HF checkpoint (default: build the tiny model in a temp dir)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--accelerated", action="store_true", help="the engine with the CPU accelerator (--cpu.enable)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model_dir = args.model_dir
    if model_dir is None:
        from instar.data.tiny_model import build_tiny_model
        model_dir = build_tiny_model(tempfile.mkdtemp(prefix="instar-bench-"))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts, budgets, observations = workload(model.config.vocab_size)
    loop = asyncio.new_event_loop()
    accelerator = None
    if args.accelerated:
        from instar.cpu import engine_process
        accelerator = engine_process()(model)
    engine = EmbeddedEngine(copy.deepcopy(model), EngineConfig(max_num_seqs=SESSIONS), accelerator=accelerator)
    runs = {
        ("batch", "embedded"): lambda: loop.run_until_complete(engine_batch(engine, prompts)),
        ("batch", "hf"): lambda: hf_batch(model, prompts),
        ("agent", "embedded"): lambda: loop.run_until_complete(engine_agent(engine, prompts, budgets, observations)),
        ("agent", "hf"): lambda: hf_agent(model, prompts, budgets, observations),
    }
    try:
        with torch.inference_mode():
            loop.run_until_complete(engine_batch(engine, prompts[:4]))  # warm-up
            hf_generate(model, prompts[:4], 4)
            rates: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
            for _ in range(args.repeats):
                for key, run in runs.items():
                    rates[key].append(rate(run))
            mid = {key: statistics.median(values) for key, values in rates.items()}
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    for name, what in (("batch", "64 prompts x 64 tokens"), ("agent", "64 sessions x 4 turns")):
        print(f"{name} ({what}): embedded ({'accelerated' if args.accelerated else 'default'}) "
              f"{mid[name, 'embedded']:.0f} tok/s, "
              f"HF generate {mid[name, 'hf']:.0f} tok/s")
    print(f"batch_ratio={mid['batch', 'embedded'] / mid['batch', 'hf']:.2f}")
    print(f"agent_ratio={mid['agent', 'embedded'] / mid['agent', 'hf']:.2f}")


if __name__ == "__main__":
    main()

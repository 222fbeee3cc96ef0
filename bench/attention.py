"""Trainer forward + backward on packed rows: instar's per-sequence attention (`packed_attention`,
what `load_model` uses) against transformers' SDPA with the block-diagonal mask it builds from the
restarting position_ids, on the demo's tiny model (4 layers, hidden 128), measured in one run.

Each row packs 170-token sequences (the calculator task's RL samples are ~100-170 tokens); rows of
512 and 2,048 tokens. Each figure is the median of --repeats timings, both sides interleaved so that
load from other processes hits them alike. The last lines are `ratio_<row tokens>=<sdpa / packed>`.

    OMP_NUM_THREADS=1 python bench/attention.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from instar.data.tiny_model import TinySpec, build_tiny_model
from instar.train.model import forward_logits, load_model

SEQUENCE = 170


def row(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 500, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    lengths = [SEQUENCE] * (tokens // SEQUENCE) + ([tokens % SEQUENCE] if tokens % SEQUENCE else [])
    return ids, torch.cat([torch.arange(n) for n in lengths])[None]


def step_seconds(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> float:
    start = time.perf_counter()
    forward_logits(model, ids, pos).logsumexp(-1).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, TinySpec(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256)))
        packed, masked = load_model(path), AutoModelForCausalLM.from_pretrained(path)
    ratios = {}
    for tokens in (512, 2048):
        ids, pos = row(tokens)
        times: dict[str, list[float]] = {"packed": [], "sdpa": []}
        for model in (packed, masked):
            step_seconds(model, ids, pos)  # warm-up
        for _ in range(args.repeats):
            for name, model in (("packed", packed), ("sdpa", masked)):
                times[name].append(step_seconds(model, ids, pos))
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        print(f"{tokens}-token row: packed {med['packed']:.1f} ms, sdpa + mask {med['sdpa']:.1f} ms")
        ratios[tokens] = med["sdpa"] / med["packed"]
    for tokens, ratio in ratios.items():
        print(f"ratio_{tokens}={ratio:.2f}")


if __name__ == "__main__":
    main()

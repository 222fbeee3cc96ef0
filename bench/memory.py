"""Trainer memory at real size on CPU, each figure from a fresh process's resident memory (RSS; peaks
from the kernel's high-water mark, reset at each baseline).

(a) A random Qwen3 of 0.46B parameters (hidden 1024, 24 layers, 16 heads of 64, 8 kv heads, MLP 3072,
vocab 151,936, tied embeddings; written once as a bfloat16 safetensors checkpoint) built on 1 and on
2 FSDP ranks the way the trainer builds it at real size (`instar.train.load.meta_model`,
`instar.train.parallel.apply_fsdp` on the meta model, `materialize` reading each rank's slices), in
float32, then one AdamW step on a 64-token row. Per rank, above the RSS after imports: the peak, and
the parameters + optimizer state still resident after the step (gradients released, freed heap
pages handed back to the system), next to the bytes those tensors hold. Then the same on one rank with
LoRA adapters of rank 16 on every linear layer (`--actor.lora_rank 16`): parameters + gradients +
optimizer state against full training's.

(b) The logprob pass (`next_token_logprobs` with entropy, forward + backward) on random bfloat16
logits of 151,936 vocab: peak RSS above the logits' own, chunked against the plain autograd formula
(one float32 log-softmax over all rows, instar before chunking). Every tensor of the plain formula
is tokens x vocab, so its peak is linear in tokens; at 8,192 tokens it needs ~25 GB, more than this
2-core / 24 GiB machine should give it: it is measured at 1,024 and 2,048 tokens and extrapolated on
that line to 8,192, where the chunked pass is measured.

    .venv/bin/python bench/memory.py    # 75 s on 2 idle cores (4.5 min shared); last lines: ratios, goals
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

VOCAB = 151_936
MIB = 2**20


def rss() -> int:
    """Resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Start the peak RSS from here. (``getrusage``'s ru_maxrss would not do: it survives exec, so a
    fresh process starts at the RSS of the process that started it.)"""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """Resident bytes at most since `reset_peak` (or since the process started)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def build_checkpoint(path: str) -> None:
    """A random Qwen3 of ~0.46B parameters as a bfloat16 safetensors checkpoint (once per path)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=64, intermediate_size=3072, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def rank_job(rank: int, world: int, port: int, path: str, lora_rank: int = 0) -> dict[str, float]:
    """Build, load and step on one of ``world`` ranks (with ``lora_rank``: LoRA adapters on every linear layer,
    as `instar.train.load.load_sharded` builds them); what it measured."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from instar.config import ActorConfig, FSDPConfig
    from instar.train.load import materialize, meta_model
    from instar.train.lora import apply_lora, initial_adapters
    from instar.train.model import forward_logits, next_token_logprobs
    from instar.train.optim import build_optimizer
    from instar.train.parallel import apply_fsdp, init_distributed
    init_distributed(rank, world, "127.0.0.1", port)
    meta_model(path, "float32", "packed")  # imports the model code: the baseline holds every import, no weights
    reset_peak()
    base = rss()
    start = time.perf_counter()
    model = meta_model(path, "float32", "packed")
    actor = ActorConfig(lora_rank=lora_rank, lora_alpha=2 * lora_rank)
    if lora_rank:
        apply_lora(model, actor)
    apply_fsdp(model, init_device_mesh("cpu", (world,)), FSDPConfig(num_ranks=world))
    stats = materialize(model, path, "cpu", adapters=initial_adapters(actor) if lora_rank else None)
    load_s, loaded = time.perf_counter() - start, rss() - base
    optimizer = build_optimizer(model, lr=1e-5)
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(rank))
    logp, _ = next_token_logprobs(forward_logits(model, ids, torch.arange(64)[None]), ids)
    logp.mean().backward()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    grads = sum(local(p.grad).nbytes for p in model.parameters() if p.grad is not None)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back: what stays resident is held
    tensors = sum(local(p).nbytes for p in model.parameters()) + sum(
        local(v).nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim)
    out = {"peak": peak_rss() - base, "resident": rss() - base, "loaded": loaded, "tensors": tensors,
           "read": stats.bytes, "load_s": load_s, "grads": grads}
    dist.destroy_process_group()
    return out


def logprob_pass(tokens: int, chunked: bool) -> dict[str, float]:
    """Forward + backward of the logprob pass on random bf16 logits; the RSS it added at its peak."""
    import torch

    from instar.train.model import next_token_logprobs
    logits = torch.empty(1, tokens, VOCAB, dtype=torch.bfloat16)
    for a in range(0, tokens, 512):  # filled in slices: no float32 logits-sized temporary before the baseline
        logits[0, a:a + 512] = torch.randn(min(512, tokens - a), VOCAB) * 4
    logits.requires_grad_()
    ids = torch.randint(0, VOCAB, (1, tokens))
    reset_peak()
    base, start = rss(), time.perf_counter()
    if chunked:
        logp, entropy = next_token_logprobs(logits, ids, 1.0, with_entropy=True)
    else:  # instar before chunking: every intermediate is a float32 [tokens, vocab] tensor
        full = torch.log_softmax(logits[0].float() / 1.0, dim=-1)
        logp = full.gather(-1, torch.roll(ids[0], -1)[:, None]).squeeze(-1)
        entropy = -(full.exp() * full).sum(-1)
        del full
    (logp.mean() - 0.01 * entropy.mean()).backward()
    return {"extra": peak_rss() - base, "seconds": time.perf_counter() - start, "logits": logits.nbytes}


def in_fresh_process(*args: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/instar_bench_memory", help="where the checkpoint is written "
                        "(kept: a second run reuses it)")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the chunked logprob pass")
    parser.add_argument("--pass", dest="one_pass", nargs=2, metavar=("TOKENS", "chunked|full"),
                        help="(internal) run one logprob pass in this process and print its JSON")
    args = parser.parse_args()
    if args.one_pass:
        print(json.dumps(logprob_pass(int(args.one_pass[0]), args.one_pass[1] == "chunked")))
        return
    from instar.train.launch import run_ranks
    start = time.perf_counter()
    path = os.path.join(args.workdir, "qwen3-0.46b")
    build_checkpoint(path)
    ranks = {world: run_ranks(rank_job, world, path, timeout=900) for world in (1, 2)}
    for world, results in ranks.items():
        for r, m in enumerate(results):
            print(f"{world} rank(s), rank {r}: peak RSS +{m['peak'] / MIB:,.0f} MiB, params + optimizer resident "
                  f"+{m['resident'] / MIB:,.0f} MiB (tensors {m['tensors'] / MIB:,.0f} MiB), after load "
                  f"+{m['loaded'] / MIB:,.0f} MiB, read {m['read'] / MIB:,.0f} MiB in {m['load_s']:.1f} s")
    worst = {world: {k: max(m[k] for m in results) for k in ("peak", "resident", "tensors")}
             for world, results in ranks.items()}
    state_ratio = worst[2]["resident"] / worst[1]["resident"]
    print(f"peak_rss_ratio={worst[2]['peak'] / worst[1]['peak']:.3f}")
    print(f"param_optimizer_ratio={state_ratio:.3f} (tensor bytes {worst[2]['tensors'] / worst[1]['tensors']:.3f})")
    lora = run_ranks(rank_job, 1, path, 16, timeout=900)[0]
    full = ranks[1][0]
    print(f"LoRA rank 16 on every linear layer, 1 rank: params + optimizer resident +{lora['resident'] / MIB:,.0f} "
          f"MiB (tensors {lora['tensors'] / MIB:,.0f} MiB, gradients {lora['grads'] / MIB:,.0f} MiB); full training: "
          f"tensors {full['tensors'] / MIB:,.0f} MiB, gradients {full['grads'] / MIB:,.0f} MiB")
    lora_ratio = (lora["tensors"] + lora["grads"]) / (full["tensors"] + full["grads"])
    print(f"lora_state_ratio={lora_ratio:.3f} (resident after the step {lora['resident'] / full['resident']:.3f})")
    print(f"(a) took {time.perf_counter() - start:.0f} s")
    start_b = time.perf_counter()
    passes = {(n, kind): in_fresh_process("--pass", str(n), kind)
              for n, kind in [(1024, "full"), (2048, "full"), (1024, "chunked"), (2048, "chunked"),
                              (args.tokens, "chunked")]}
    for (n, kind), m in passes.items():
        print(f"logprob pass {n} x {VOCAB} {kind}: +{m['extra'] / MIB:,.0f} MiB above the logits "
              f"({m['logits'] / MIB:,.0f} MiB), {m['seconds']:.1f} s")
    for n in (1024, 2048):
        print(f"logprob_peak_ratio_{n}={passes[(n, 'chunked')]['extra'] / passes[(n, 'full')]['extra']:.3f} (measured)")
    small, large = passes[(1024, "full")]["extra"], passes[(2048, "full")]["extra"]
    full_at = large + (large - small) * (args.tokens - 2048) / 1024
    logprob_ratio = passes[(args.tokens, "chunked")]["extra"] / full_at
    print(f"full formula at {args.tokens} tokens, extrapolated: +{full_at / MIB:,.0f} MiB")
    print(f"(b) took {time.perf_counter() - start_b:.0f} s")
    print(f"logprob_peak_ratio={logprob_ratio:.3f}")
    print(f"goal params+optimizer per rank, 2 ranks <= 0.55 x 1 rank: {state_ratio:.3f} "
          f"{'PASS' if state_ratio <= 0.55 else 'FAIL'}")
    print(f"goal LoRA rank 16 params+gradients+optimizer <= 0.35 x full training: {lora_ratio:.3f} "
          f"{'PASS' if lora_ratio <= 0.35 else 'FAIL'}")
    print(f"goal chunked logprob peak <= 0.25 x unchunked at {args.tokens} tokens: {logprob_ratio:.3f} "
          f"{'PASS' if logprob_ratio <= 0.25 else 'FAIL'}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

"""Weight-sync throughput: trainer rank 0 broadcasts a model to one engine over gloo on 127.0.0.1.

Two local processes run the real `send_weights` and `receive_weights`:
(a) tiny: the demo's tiny model (scripts/demo.sh shape), received by a real `EmbeddedEngine` through
    its `update_weights`;
(b) 50m: a random ~52M-parameter Qwen3-shaped float32 state dict (no download), received into
    preallocated tensors with the same `copy_` the engine does;
(c) 50m-fresh: (b) with every bucket received into fresh memory (`reuse_buffer=False`, what a vLLM
    worker gets): the page faults that a kept buffer avoids.
Every case checks that the receiver ends with exactly the sent weights.

GB/s is payload bytes over the receiver's time from a shared barrier to its last copy, median of
--repeats syncs. The phase split comes from timing the module's own steps: the bench wraps
weight_sync's `_broadcast` and `pickle` (sender: pack = send time - broadcast - pickle; receiver:
broadcast wait, which includes waiting for the sender to pack, unpickle, and the copy into the
model). The last two lines are `tiny_gb_per_s=<x>` and `sync_50m_gb_per_s=<y>`.

    OMP_NUM_THREADS=1 python bench/weight_sync.py [--repeats 7] [--bucket-mb 256]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import torch
from transformers.utils import logging as hf_logging

import instar.train.weight_sync as ws
from instar.data.tiny_model import TinySpec, build_tiny_model
from instar.train.launch import run_ranks

DEMO_SPEC = TinySpec(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256)
hf_logging.disable_progress_bar()  # here, so the spawned ranks that import this module get it too


def qwen3_state_dict(random: bool, vocab=32768, hidden=512, layers=6, heads=8, kv_heads=4, head_dim=64,
                     intermediate=1536) -> dict[str, torch.Tensor]:
    """Qwen3 parameter names and shapes (untied head), ~52M parameters with the defaults: seeded
    random values (the same in every process) or zeros."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                   p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                   p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
                   p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
                   p + "mlp.down_proj.weight": (hidden, intermediate),
                   p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) if random else torch.zeros(shape) for name, shape in shapes.items()}


def tiny_params(model_dir: str) -> dict[str, torch.Tensor]:
    """The tiny model's weights plus one, so that a sync visibly changes what the engine loaded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # a tied head is the embedding: shifted once
            p.add_(1.0)
    return dict(model.named_parameters())


class Timers:
    """Wraps weight_sync's broadcast and pickle calls in this process and sums their seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        broadcast, pickle = ws._broadcast, ws.pickle
        ws._broadcast = self._timed("broadcast", broadcast)
        ws.pickle = SimpleNamespace(dumps=self._timed("pickle", pickle.dumps),
                                    loads=self._timed("pickle", pickle.loads))

    def _timed(self, key, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
        return wrapper

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def _job(rank: int, world: int, port: int, case: str, model_dir: str, repeats: int, bucket_mb: float) -> list[dict]:
    group = ws.open_sync_group("127.0.0.1", port, rank, world)
    timers, runs = Timers(), []
    receive = partial(ws.receive_weights, reuse_buffer=case != "50m-fresh")
    if rank == 0:
        state = tiny_params(model_dir) if case == "tiny" else qwen3_state_dict(random=True)
        for _ in range(repeats + 1):  # the first sync is a warm-up
            group.pg.barrier().wait()
            start = time.perf_counter()
            stats = ws.send_weights(iter(state.items()), group, bucket_mb=bucket_mb)
            runs.append({"total": time.perf_counter() - start, "bytes": stats["weight_sync/bytes"],
                         "buckets": stats["weight_sync/buckets"], **timers.take()})
        return runs[1:]
    if case == "tiny":
        from instar.engines.embedded import EmbeddedEngine
        engine = EmbeddedEngine.from_pretrained(model_dir)
        loop = asyncio.new_event_loop()
        loop.run_until_complete(engine.pause("keep"))
    else:
        dest = qwen3_state_dict(random=False)
    copy_seconds = 0.0

    def copied(stream):  # time spent in the consumer, between the generator's yields
        nonlocal copy_seconds
        for item in stream:
            start = time.perf_counter()
            yield item
            copy_seconds += time.perf_counter() - start

    for version in range(1, repeats + 2):
        group.pg.barrier().wait()
        start, copy_seconds = time.perf_counter(), 0.0
        if case == "tiny":
            loop.run_until_complete(engine.update_weights(copied(receive(group)), version))
        else:
            with torch.no_grad():
                for name, tensor in copied(receive(group)):
                    dest[name].copy_(tensor)
        runs.append({"total": time.perf_counter() - start, "copy": copy_seconds, **timers.take()})
    if case == "tiny":
        loop.run_until_complete(engine.close())
        received, expected = dict(engine.model.named_parameters()), tiny_params(model_dir)
    else:
        received, expected = dest, qwen3_state_dict(random=True)
    if received.keys() != expected.keys() or not all(torch.equal(received[n], t) for n, t in expected.items()):
        raise AssertionError(f"{case}: the engine's weights differ from the sent ones after the sync")
    return runs[1:]


def report(case: str, sent: list[dict], got: list[dict]) -> float:
    med = lambda runs, key: statistics.median(r.get(key, 0.0) for r in runs)  # noqa: E731
    nbytes, total = sent[0]["bytes"], med(got, "total")
    pack = med(sent, "total") - med(sent, "broadcast") - med(sent, "pickle")
    recv_other = total - med(got, "broadcast") - med(got, "pickle") - med(got, "copy")
    gb_s = nbytes / total / 1e9
    print(f"{case}: {nbytes / 1e6:.1f} MB in {sent[0]['buckets']:.0f} bucket(s), {total * 1e3:.1f} ms "
          f"(median of {len(got)}), {gb_s:.2f} GB/s")
    phases = [("sender pack (gather + copy into bucket)", pack), ("sender pickle table", med(sent, "pickle")),
              ("sender broadcast", med(sent, "broadcast")),
              ("receiver broadcast wait (incl. sender pack)", med(got, "broadcast")),
              ("receiver unpickle table", med(got, "pickle")), ("receiver copy into model", med(got, "copy")),
              ("receiver other", recv_other)]
    for name, seconds in phases:
        print(f"  {name:44s} {seconds * 1e3:8.2f} ms  {seconds / total:6.1%}")
    return gb_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed syncs per case (after one warm-up)")
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="send_weights' bucket size (its default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(tmp, DEMO_SPEC))
        rates = {}
        for case in ("tiny", "50m", "50m-fresh"):
            sent, got = run_ranks(_job, 2, case, model_dir, args.repeats, args.bucket_mb, timeout=600)
            rates[case] = report(case, sent, got)
    print(f"tiny_gb_per_s={rates['tiny']:.3f}")
    print(f"sync_50m_gb_per_s={rates['50m']:.3f}")


if __name__ == "__main__":
    main()

"""Weight sync over a dedicated gloo group: the bucketed byte stream round-trips exactly, and after a
sync the embedded engine samples with the trainer's logprobs; the table travels as JSON, never a pickle."""

import asyncio
import json
import os
import pickle
import threading
from functools import partial

import pytest
import torch
import torch.multiprocessing as mp

from instar.config import ActorConfig, FSDPConfig, RLConfig, TrainConfig
from instar.contract import Sample, SamplingParams
from instar.runtime.batching import rl_loss
from instar.train.batch import StepInputs
from instar.train.launch import reserve_port, run_ranks
from instar.train.weight_sync import open_sync_group, receive_weights, send_weights
from instar.train.worker import TrainWorker


def test_buckets_round_trip_exactly():
    params = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(300, dtype=torch.bfloat16)),
              ("c", torch.arange(5)), ("d", torch.full((40,), 2.5))]
    port, stats, received = reserve_port(), {}, []

    def sender():
        group = open_sync_group("127.0.0.1", port, 0, 2)
        # 400 bytes per bucket: "b" (600 bytes) travels alone, the others are packed together
        stats.update(send_weights(iter(params), group, bucket_mb=400 / 2**20))

    thread = threading.Thread(target=sender)
    thread.start()
    group = open_sync_group("127.0.0.1", port, 1, 2)
    received = [(name, t.clone()) for name, t in receive_weights(group)]
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert [n for n, _ in received] == ["a", "b", "c", "d"]
    for (_, sent), (_, got) in zip(params, received):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    assert stats["weight_sync/bytes"] == 24 + 600 + 40 + 160
    assert stats["weight_sync/buckets"] == 3  # [a], [b], [c, d]


def _receive_in_a_process(port, transport, out):
    group = open_sync_group("127.0.0.1", port, 1, 2, transport, timeout_s=60)
    out.put(([(name, t.cpu().tolist(), str(t.dtype)) for name, t in receive_weights(group, reuse_buffer=True)],
             group.ipc))


def test_an_ipc_sync_reads_the_trainers_gpu_buckets_or_says_why_not_and_goes_through_host_memory(capfd):
    """Another process, as an engine is: CUDA IPC maps no memory of its own process. With a GPU the buckets are
    read where the sender wrote them (two buckets: the second reuses the first's memory after the barrier);
    without one (here), the probe fails, one line says so, and the same buckets arrive through host memory."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = [("a", torch.arange(6, dtype=torch.float32, device=device)), ("b", torch.ones(300, dtype=torch.bfloat16,
                                                                                           device=device))]
    ctx, port = mp.get_context("spawn"), reserve_port()
    out = ctx.Queue()
    receiver = ctx.Process(target=_receive_in_a_process, args=(port, "ipc", out))
    receiver.start()
    try:
        group = open_sync_group("127.0.0.1", port, 0, 2, "ipc", timeout_s=60)
        stats = send_weights(iter(params), group, bucket_mb=400 / 2**20)
        received, mapped = out.get(timeout=60)
    finally:
        receiver.join(timeout=60)
        receiver.kill()
    assert group.ipc == mapped == (device == "cuda") and stats["weight_sync/buckets"] == 2
    assert received == [(name, t.cpu().tolist(), str(t.dtype)) for name, t in params]
    if device == "cpu":
        assert capfd.readouterr().out.count("no CUDA IPC here") == 1


def test_a_background_send_returns_with_a_copy_and_the_next_send_waits_for_it():
    """A model in one bucket: send_weights returns before the receiver has taken anything (the trainer
    trains meanwhile), what arrives is the weights as they were when it returned, and the next send first
    waits for that broadcast; a model of several buckets is sent before send_weights returns."""
    params = [("w", torch.arange(8, dtype=torch.float32)), ("v", torch.ones(3))]
    port, stats, receiving = reserve_port(), [], threading.Event()

    def sender():
        group = open_sync_group("127.0.0.1", port, 0, 2)
        stats.append(send_weights(iter(params), group, background=True))
        stats.append(receiving.is_set())  # returned while the receiver had not asked yet
        params[0][1].mul_(-1)  # the next update changes the weights in place
        stats.append(send_weights(iter(params), group, background=True))
        stats.append(send_weights(iter(params), group, bucket_mb=32 / 2**20, background=True))
        group.wait_sent()

    thread = threading.Thread(target=sender)
    thread.start()
    group = open_sync_group("127.0.0.1", port, 1, 2)
    thread.join(timeout=0.5)  # the sender is done with the first send
    receiving.set()
    syncs = [[(name, t.clone()) for name, t in receive_weights(group)] for _ in range(3)]
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert stats[1] is False
    assert [s["weight_sync/background"] for s in (stats[0], stats[2], stats[3])] == [1.0, 1.0, 0.0]
    assert torch.equal(syncs[0][0][1], torch.arange(8.0)) and torch.equal(syncs[1][0][1], -torch.arange(8.0))
    assert torch.equal(syncs[2][0][1], -torch.arange(8.0)) and [n for n, _ in syncs[2]] == ["w", "v"]


def test_a_bucket_table_travels_only_when_it_changed(monkeypatch):
    """Both ends keep each bucket's table: a sync whose names, dtypes and shapes are those of the last one
    sends a header and the flat buffer only (two broadcasts, each a rendezvous of two busy processes);
    a changed table travels again and is used from then on."""
    from instar.train import weight_sync

    sent: list[int] = []
    broadcast = weight_sync._broadcast

    def counted(group, tensor):
        if group.rank == 0:
            sent.append(tensor.numel())
        return broadcast(group, tensor)

    monkeypatch.setattr(weight_sync, "_broadcast", counted)
    first = [("w", torch.arange(4, dtype=torch.float32)), ("v", torch.ones(2))]
    changed = [("w", torch.arange(6, dtype=torch.float32)), ("v", torch.ones(2))]
    syncs = [first, [(n, t + 1) for n, t in first], changed, [(n, t * 3) for n, t in changed]]
    port, per_sync = reserve_port(), []

    def sender():
        group = open_sync_group("127.0.0.1", port, 0, 2)
        for params in syncs:
            before = len(sent)
            send_weights(iter(params), group)
            per_sync.append(len(sent) - before)

    thread = threading.Thread(target=sender)
    thread.start()
    group = open_sync_group("127.0.0.1", port, 1, 2)
    got = [[(name, t.clone()) for name, t in receive_weights(group, reuse_buffer=True)] for _ in syncs]
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert per_sync == [3, 2, 3, 2]
    for params, received in zip(syncs, got):
        assert [n for n, _ in received] == ["w", "v"]
        assert all(torch.equal(g, t) for (_, t), (_, g) in zip(params, received))


class _Mkdir:
    """Unpickled, this creates a directory: the proof that the receiver ran code it was sent."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_the_table_travels_as_json_and_a_pickle_in_its_place_is_never_unpickled(tmp_path, monkeypatch):
    from instar.train import weight_sync

    sent: list[bytes] = []
    broadcast = weight_sync._broadcast

    def recorded(group, tensor):
        if group.rank == 0:
            sent.append(tensor.cpu().numpy().tobytes())
        return broadcast(group, tensor)

    monkeypatch.setattr(weight_sync, "_broadcast", recorded)
    payload = pickle.dumps(_Mkdir(str(tmp_path / "ran")))
    port = reserve_port()

    def sender():
        group = open_sync_group("127.0.0.1", port, 0, 2)
        send_weights(iter([("w", torch.ones(2, 3)), ("v", torch.arange(3))]), group)
        # a forged bucket: a pickle where the table goes, then the last-bucket flag
        recorded(group, torch.tensor([len(payload), 0, 1]))
        recorded(group, torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    thread = threading.Thread(target=sender)
    thread.start()
    group = open_sync_group("127.0.0.1", port, 1, 2)
    assert [(n, t.tolist()) for n, t in receive_weights(group)] == [("w", [[1.0] * 3] * 2), ("v", [0, 1, 2])]
    with pytest.raises(ValueError):  # the bytes are not JSON
        list(receive_weights(group))
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert json.loads(sent[1]) == [["w", "float32", [2, 3], 0, 24], ["v", "int64", [3], 64, 24]]
    assert not os.path.exists(tmp_path / "ran")


def test_mixed_dtypes_strided_and_cast_tensors_round_trip_twice_through_one_kept_buffer():
    # "a" is 6 bytes: packed unaligned, "b" could not be viewed as float32 on the receiver
    first = [("a", torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)),
             ("b", torch.arange(6, dtype=torch.float32).reshape(2, 3).t()),  # strided
             ("c", torch.tensor(7)), ("d", torch.linspace(0, 1, 100))]
    second = [(n, t * 2 - 1) for n, t in first]
    port, stats = reserve_port(), []

    def sender():
        group = open_sync_group("127.0.0.1", port, 0, 2)
        stats.append(send_weights(iter(first), group, bucket_mb=256 / 2**20))
        stats.append(send_weights(iter(second), group, bucket_mb=256 / 2**20, dtype=torch.bfloat16))

    thread = threading.Thread(target=sender)
    thread.start()
    group = open_sync_group("127.0.0.1", port, 1, 2)
    got_first = [(name, t.clone()) for name, t in receive_weights(group, reuse_buffer=True)]
    pointers, got_second = set(), []
    for name, t in receive_weights(group, reuse_buffer=True):  # copied before the next bucket overwrites it
        pointers.add(t.untyped_storage().data_ptr())
        got_second.append((name, t.clone()))
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert [n for n, _ in got_first] == [n for n, _ in got_second] == ["a", "b", "c", "d"]
    for (_, t), (_, g) in zip(first, got_first):
        assert g.dtype == t.dtype and torch.equal(g, t)
    for (_, t), (_, g) in zip(second, got_second):
        assert g.dtype == torch.bfloat16 and torch.equal(g, t.to(torch.bfloat16))
    # buckets of 256 bytes, tensors at 64-byte offsets: [a, b, c] at 0, 64, 128, then [d] alone
    assert [(s["weight_sync/bytes"], s["weight_sync/buckets"]) for s in stats] == [(6 + 24 + 8 + 400, 2),
                                                                                  (6 + 12 + 2 + 200, 2)]
    # the second sync landed in the buffer the first one left in the group (400 bytes: "d" in fp32)
    assert pointers == {group.buffer.untyped_storage().data_ptr()} and group.buffer.numel() == 400


def _trainer_job(rank, world, port, model_dir, sync_port, prompts, inbox, outbox):
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir), learning_rate=1e-2), FSDPConfig(num_ranks=1),
                    TrainConfig(max_tokens_per_gpu=256))
    w.init(rank, world, "127.0.0.1", port)
    # one step so the trainer's weights are no longer the ones on disk that the engine loaded
    samples = [Sample(p + [7, 8, 9], [0] * len(p) + [1, 1, 1], [0.0] * len(p) + [-1.0] * 3,
                      [-1] * len(p) + [0] * 3) for p in prompts]
    adv = [torch.full((len(s.token_ids),), 1.0) for s in samples]
    cfg = RLConfig()  # token-level truncated IS: the samples' rollout logprobs are made up
    cfg.algo.advantage.is_correction_level, cfg.algo.advantage.is_correction_mode = "token", "trunc"
    w.train_policy(samples, partial(rl_loss, cfg, 0.0), StepInputs(advantages=adv))
    w.open_weight_sync("127.0.0.1", sync_port, 2)
    stats = w.send_weights(bucket_mb=0.05)
    # plain lists: a queued tensor lives in this process's shared memory, gone once the rank exits
    outbox.put([lp.tolist() for lp in w.compute_logprobs(inbox.get(timeout=120))])
    w.shutdown()
    return stats


def test_engine_logprobs_equal_the_trainers_after_a_sync(tiny_model_dir):
    from instar.engines.embedded import EmbeddedEngine

    prompts = [[5, 17, 42, 99, 3], [250, 11, 12]]
    ctx = mp.get_context("spawn")
    inbox, outbox, sync_port, result = ctx.Queue(), ctx.Queue(), reserve_port(), []
    trainer = threading.Thread(target=lambda: result.append(
        run_ranks(_trainer_job, 1, tiny_model_dir, sync_port, prompts, inbox, outbox, timeout=180)))
    trainer.start()
    engine = EmbeddedEngine.from_pretrained(tiny_model_dir)

    async def sync_and_generate():
        before = await engine.generate(prompts[0], SamplingParams(max_tokens=6, seed=0))
        group = open_sync_group("127.0.0.1", sync_port, 1, 2)
        await engine.pause("keep")
        await engine.update_weights(receive_weights(group, reuse_buffer=True), version=1)
        await engine.resume()
        gens = [await engine.generate(p, SamplingParams(max_tokens=6, seed=0)) for p in prompts]
        await engine.close()
        return before, gens

    before, gens = asyncio.run(sync_and_generate())
    samples = [Sample(p + g.token_ids, [0] * len(p) + [1] * len(g.token_ids), [0.0] * len(p) + g.logprobs,
                      [-1] * len(p) + g.versions) for p, g in zip(prompts, gens)]
    inbox.put(samples)
    trainer_logprobs = outbox.get(timeout=120)
    trainer.join(timeout=120)
    assert not trainer.is_alive() and result, "the trainer rank did not finish"
    stats = result[0][0]
    assert engine.version == 1 and all(v == 1 for g in gens for v in g.versions)
    for p, g, lp in zip(prompts, gens, trainer_logprobs):
        torch.testing.assert_close(torch.tensor(lp[len(p):]), torch.tensor(g.logprobs), atol=1e-4, rtol=0)
    # the sync changed what the engine computes (same seed, same prompt, new weights)
    assert before.token_ids != gens[0].token_ids or max(
        abs(a - b) for a, b in zip(before.logprobs, gens[0].logprobs)) > 1e-3
    n_bytes = sum(p.numel() * 4 for p in engine.model.parameters())  # fp32, tied head counted once
    assert stats["weight_sync/bytes"] == n_bytes and stats["weight_sync/buckets"] > 1
    print(f"weight sync: {stats['weight_sync/mb_per_s']:.1f} MB/s over {stats['weight_sync/buckets']:.0f} buckets")

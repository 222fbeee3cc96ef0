"""--fsdp.compile: the trainer's dense decoder layers through torch.compile train like eager ones (same
logprobs, metrics and weights after 3 steps, within float32 reordering), on one rank, on two
context-parallel FSDP2 ranks with activation checkpointing, and in `instar rl` beside the engine;
one graph serves every thread count a rank lends itself; MoE layers and vision blocks stay eager; tensor
parallelism with it is refused."""

import pytest
import torch
from helpers.layouts import assert_same, check_equals_one_rank, make_sample, rl_two_steps, train_job

from instar.checks import check_layout
from instar.config import ConfigError, FSDPConfig
from instar.train.launch import reserve_port
from instar.train.model import decoder_layers, load_model
from instar.train.parallel import compile_layers
from instar.train.worker import TrainWorker

LENGTHS = [7, 12, 5, 9, 3, 10, 4, 8]
SAMPLES = [make_sample(n, i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def eager(tiny_heads4_dir):
    return train_job(0, 1, reserve_port(), tiny_heads4_dir, {}, SAMPLES, None)


@pytest.mark.slow
def test_compiled_layers_train_like_eager(tiny_heads4_dir, eager, monkeypatch):
    compiled = []
    make = TrainWorker._load

    def load(self, *args, **kwargs):  # the layers the worker's models run
        model = make(self, *args, **kwargs)
        compiled.extend(layer.forward for layer in decoder_layers(model))
        return model

    monkeypatch.setattr(TrainWorker, "_load", load)
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    assert_same(train_job(0, 1, reserve_port(), tiny_heads4_dir, {"compile": True}, SAMPLES, None), eager)
    assert compiled and all(hasattr(f.compiled, "_torchdynamo_orig_callable") for f in compiled)
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames  # graphs were built and run, not skipped


@pytest.mark.slow
def test_compiled_context_parallel_fsdp_ranks_with_checkpointing_equal_one_rank(tiny_heads4_dir, eager, tmp_path):
    """Two ranks: cp 2, FSDP2 sharding over them, activation checkpointing; their checkpoint resumes eager."""
    check_equals_one_rank(tiny_heads4_dir, SAMPLES, eager, 2,
                          {"compile": True, "cp_size": 2, "activation_checkpointing": True}, {}, str(tmp_path / "ckpt"))


@pytest.mark.slow
def test_rl_with_compiled_trainer_matches_the_engine(tmp_path, tiny_heads4_dir):
    """`instar rl --fsdp.compile true`, strictly on-policy: the compiled trainer's logprobs agree with the
    eager engine's at both steps (step 2 after the weight sync)."""
    metrics = rl_two_steps(tmp_path, tiny_heads4_dir, compile=True)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(abs(m["actor/vllm_kl"]) < 1e-3 for m in metrics) and metrics[0]["actor/grad_norm"] > 0


def test_moe_layers_and_vision_blocks_stay_eager(tiny_moe_dir, tiny_vlm_dir, tiny_heads4_dir):
    compiled = {}
    for path in (tiny_moe_dir, tiny_vlm_dir, tiny_heads4_dir):
        model = load_model(str(path), "float32", "hf", "auto")
        compile_layers(model)
        compiled[path] = [(type(layer).__name__, hasattr(layer.forward, "compiled"))
                          for layer in decoder_layers(model)]
    assert {c for _, c in compiled[tiny_moe_dir]} == {False}
    assert {c for _, c in compiled[tiny_heads4_dir]} == {True}
    assert {name: c for name, c in compiled[tiny_vlm_dir]} == {"Qwen3VLTextDecoderLayer": True,
                                                               "Qwen3VLVisionBlock": False}
    assert FSDPConfig().compile is False


def test_thread_counts_and_grad_modes_share_one_graph(tiny_heads4_dir):
    """A rank lends cores between layers (torch.set_num_threads): the compiled layers keep the graph they
    built first for every thread count, run eager without gradients, and give the eager model's logits
    and gradients."""
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 11))
    ref, model = (load_model(str(tiny_heads4_dir)) for _ in range(2))
    compile_layers(model)
    torch._dynamo.reset()
    graphs, threads = torch._dynamo.utils.counters["stats"], torch.get_num_threads()
    try:
        for k, (n, grad) in enumerate(((1, True), (2, True), (1, False), (2, False), (1, True))):
            torch.set_num_threads(n)
            with torch.set_grad_enabled(grad):
                out, expect = model(ids).logits, ref(ids).logits
            torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-5)
            if grad:
                out.square().mean().backward()
                expect.square().mean().backward()
            if k == 0:
                built = graphs["unique_graphs"]
    finally:
        torch.set_num_threads(threads)
    assert built > 0 and graphs["unique_graphs"] == built
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_tensor_parallel_with_compile_is_refused():
    check_layout(FSDPConfig(num_ranks=2, cp_size=2, compile=True))  # context parallel compiles (measured equal)
    with pytest.raises(ConfigError, match="--fsdp.compile does not run with --fsdp.tp_size > 1"):
        check_layout(FSDPConfig(num_ranks=2, tp_size=2, compile=True))

"""--fsdp.compile: the trainer's dense decoder layers through torch.compile train like eager ones (same
logprobs, metrics and weights after 3 steps, within float32 reordering), on one rank, on two
context-parallel FSDP2 ranks with activation checkpointing, and in `instar rl` beside the engine;
MoE layers and vision blocks stay eager; tensor parallelism with it is refused."""

import pytest
import torch
from layouts import assert_same, check_equals_one_rank, make_sample, rl_two_steps, train_job

from instar.checks import check_layout
from instar.config import ConfigError, FSDPConfig
from instar.train.launch import free_port
from instar.train.model import decoder_layers, load_model
from instar.train.parallel import compile_layers
from instar.train.worker import TrainWorker

LENGTHS = [7, 12, 5, 9, 3, 10, 4, 8]
SAMPLES = [make_sample(n, i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def eager(tiny_heads4_dir):
    return train_job(0, 1, free_port(), tiny_heads4_dir, {}, SAMPLES, None)


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
    assert_same(train_job(0, 1, free_port(), tiny_heads4_dir, {"compile": True}, SAMPLES, None), eager)
    assert compiled and all(hasattr(f, "_torchdynamo_orig_callable") for f in compiled)
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
        compiled[path] = [(type(layer).__name__, hasattr(layer.forward, "_torchdynamo_orig_callable"))
                          for layer in decoder_layers(model)]
    assert {c for _, c in compiled[tiny_moe_dir]} == {False}
    assert {c for _, c in compiled[tiny_heads4_dir]} == {True}
    assert {name: c for name, c in compiled[tiny_vlm_dir]} == {"Qwen3VLTextDecoderLayer": True,
                                                               "Qwen3VLVisionBlock": False}
    assert FSDPConfig().compile is False


def test_tensor_parallel_with_compile_is_refused():
    check_layout(FSDPConfig(num_ranks=2, cp_size=2, compile=True))  # context parallel compiles (measured equal)
    with pytest.raises(ConfigError, match="--fsdp.compile does not run with --fsdp.tp_size > 1"):
        check_layout(FSDPConfig(num_ranks=2, tp_size=2, compile=True))

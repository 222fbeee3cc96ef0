"""The vLLM engine's guard rails and settings mapping. Most run without vllm installed (the guard
rails must reject a bad run before anything starts); the sampling mapping needs vllm."""

import numpy as np
import pytest
import torch
from vllm_tier import needs_vllm

from instar.cli.main import parse
from instar.config import ConfigError, EngineConfig
from instar.contract import SamplingParams
from instar.engines.vllm import (
    EXTENSION,
    VLLMEngine,
    check_engine_config,
    engine_args,
    moe_layers,
    routed_per_token,
    to_vllm_sampling_params,
)


@pytest.mark.parametrize("changes,device,routing,message", [
    ({"num_engines": 0}, "cuda", False, "--engine.num_engines and --engine.tensor_parallel_size must be >= 1"),
    ({"gpu_memory_utilization": 1.5}, "cuda", False, "--engine.gpu_memory_utilization is a fraction in"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "cuda", False, "must be >= --engine.max_num_seqs"),
    ({"speculative_config": {"num_speculative_tokens": 3}}, "cuda", False, "needs a 'method'"),
    ({"tensor_parallel_size": 2}, "cpu", False, "use --engine.tensor_parallel_size 1"),
    ({}, "cpu", True, "vLLM returns only on GPU"),
    ({"enable_prefix_caching": False}, "cuda", True, "needs --engine.enable_prefix_caching true"),
    ({"enable_sleep_mode": True}, "cpu", False, "vLLM's CPU build has no sleep mode"),
])
def test_guard_rails_name_the_fix(changes, device, routing, message):
    with pytest.raises(ConfigError, match=message):
        check_engine_config(EngineConfig(**changes), device, routing)


def test_valid_settings_pass():
    check_engine_config(EngineConfig(tensor_parallel_size=4, speculative_config={"method": "ngram"}), "cuda", True)
    check_engine_config(EngineConfig(), "cpu")


def test_routing_replay_on_cpu_fails_at_start_up(tiny_moe_dir):
    assert not torch.cuda.is_available()
    with pytest.raises(ConfigError, match="--train.routing_replay needs the experts"):
        VLLMEngine.from_pretrained(tiny_moe_dir, routing_replay=True)


def test_vllm_flags_reach_the_engine_args():
    _, cfg = parse(["rl", "--vllm.num_engines", "3", "--vllm.tensor_parallel_size", "2",
                    "--vllm.gpu_memory_utilization", "0.7", "--vllm.enable_prefix_caching", "false",
                    "--vllm.enforce_eager", "--vllm.dtype", "bfloat16", "--vllm.logprobs_mode", "raw",
                    "--vllm.max_num_seqs", "32", "--vllm.max_num_batched_tokens", "4096", "--vllm.enable_sleep_mode",
                    "--vllm.speculative_config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert cfg.engine.num_engines == 3  # the runtime's business: one engine (AsyncLLM) per actor
    args = engine_args("/ckpt", cfg.engine, "cuda")
    assert args.pop("seed") != engine_args("/ckpt", cfg.engine, "cuda")["seed"]  # unseeded requests differ per engine
    assert args == {
        "model": "/ckpt", "dtype": "bfloat16", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.7,
        "enable_prefix_caching": False, "enforce_eager": True, "max_num_seqs": 32, "max_num_batched_tokens": 4096,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}, "logprobs_mode": "raw_logprobs",
        "max_logprobs": 0, "enable_return_routed_experts": False, "enable_sleep_mode": True,
        "generation_config": "vllm", "skip_tokenizer_init": True, "disable_log_stats": True,
        "worker_extension_cls": EXTENSION, "distributed_executor_backend": None}
    cpu = engine_args("/ckpt", EngineConfig(), "cpu", routing_replay=False)
    assert cpu["distributed_executor_backend"] == "uni" and cpu["logprobs_mode"] == "processed_logprobs"


def test_routed_rows_become_per_sampled_token():
    class Config:
        num_hidden_layers, mlp_only_layers, decoder_sparse_step = 4, [0], 1
    layers = moe_layers(Config)
    assert layers == [1, 2, 3]
    rows = np.arange(2 * 4 * 2).reshape(2, 4, 2)  # 3 sampled tokens: the last was never fed
    routed = routed_per_token(rows, 3, layers, 2)
    assert routed.dtype == torch.int64 and routed.shape == (3, 3, 2)
    assert routed[:2].tolist() == rows[:, 1:].tolist()
    assert routed[2].tolist() == [[-1, -1]] * 3
    assert routed_per_token(None, 1, layers, 2).tolist() == [[[-1, -1]] * 3]


@needs_vllm
def test_sampling_params_are_mapped_explicitly():
    from vllm.sampling_params import RequestOutputKind

    p = to_vllm_sampling_params(SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.1, max_tokens=17,
                                               stop_token_ids=[5, 6], seed=3), prompt_len=9, routing_replay=True)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.seed) == (0.7, 0.9, 0, 0.1, 17, 3)
    assert p.stop_token_ids == [5, 6] and p.ignore_eos and p.min_tokens == 0
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.logprobs == 0 and not p.detokenize and p.output_kind == RequestOutputKind.FINAL_ONLY
    assert p.routed_experts_prompt_start == 9
    assert to_vllm_sampling_params(SamplingParams(top_k=5), 9).top_k == 5


class RecordingLLM:
    """The calls an `AsyncLLM` gets, in order (no vLLM needed): sleep mode's order is instar's logic."""

    def __init__(self):
        self.calls = []
        hf_config = type("HFConfig", (), {"tie_word_embeddings": False})()
        self.model_config = type("ModelConfig", (), {"hf_config": hf_config, "max_model_len": 64,
                                                     "get_vocab_size": lambda self: 512})()

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append((name, *args, *sorted(kwargs.items())))
        return call


@pytest.mark.parametrize("path", ["receive", "update"])
def test_sleep_mode_wakes_the_weights_loads_them_then_the_kv_cache(path):
    import asyncio

    async def go() -> list:
        llm = RecordingLLM()
        engine = VLLMEngine(llm, EngineConfig(enable_sleep_mode=True))
        for version in (1, 2):
            await engine.sleep()
            await engine.pause("drain")
            if path == "receive":
                await engine.receive_weights(lambda *a: None, version)
            else:
                await engine.update_weights([("model.norm.weight", torch.ones(4))], version)
            await engine.resume()
        assert engine.stats["sleeps"] == 2
        return [c[0] if c[0] != "wake_up" else c for c in llm.calls]

    calls = asyncio.run(go())
    load = "collective_rpc"
    step = ["sleep", "pause_generation", ("wake_up", ("tags", ["weights"])), load,
            ("wake_up", ("tags", ["kv_cache"])), "reset_prefix_cache", "update_weight_version", "resume_generation"]
    assert calls == step + step

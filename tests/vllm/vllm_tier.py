"""Helpers of the vLLM tier (imported by its conftest and test modules)."""

import asyncio
import importlib.util
import threading
import time
from contextlib import contextmanager

import pytest
import torch

# Not `importorskip`: with tests/ on sys.path, this very directory is a namespace package named vllm.
_spec = importlib.util.find_spec("vllm")
HAVE_VLLM = _spec is not None and _spec.origin is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm is not installed in this venv; the vLLM tier runs with `make test-vllm` (.venv-vllm)")


class LoopThread:
    """An event loop on a daemon thread; `run` executes a coroutine there and returns its result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@contextmanager
def start_engine(model_dir, cfg):
    """Yield (engine, loop thread) for a VLLMEngine on ``model_dir``; always shuts both down. The
    engine runs on its own loop because vLLM's AsyncLLM stays bound to the loop it first ran on."""
    from instar.engines.vllm import VLLMEngine

    torch.set_num_threads(1)
    loop = LoopThread()
    engine = None
    try:
        engine = VLLMEngine.from_pretrained(model_dir, cfg)
        yield engine, loop
    finally:
        if engine is not None:
            loop.run(engine.close(), timeout=60)
        loop.stop()


def cpu_isa() -> str:
    """The instruction set vLLM's CPU build chooses its kernels by (AVX2, AVX512, AVX512 + BF16)."""
    bf16 = " + AVX512_BF16" if torch.cpu._is_avx512_bf16_supported() else ""
    return f"{torch.backends.cpu.get_cpu_capability()}{bf16}"


def hf_logits(model, prompt, tokens):
    """Logits that predicted each of ``tokens`` after ``prompt``, shape (len(tokens), vocab), fp32."""
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()


def hf_logprobs(model, prompt, tokens):
    logits = hf_logits(model, prompt, tokens)
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def wait_until(condition, timeout: float = 30.0) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out waiting for the engine"
        time.sleep(0.01)

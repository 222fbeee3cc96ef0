"""Shared fixtures: tiny models built once per test session, one compute thread per process."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: 2 cores are shared
import shutil
import tempfile

# the CPU accelerator's builds go to a cache of this test session (Ray workers inherit the variable)
os.environ["INSTAR_CACHE"] = tempfile.mkdtemp(prefix="instar-test-cache-")

import json
from types import SimpleNamespace

import pytest
import torch

from instar.data.tiny_model import TinySpec, build_tiny_model

torch.set_num_threads(1)
pytest.register_assert_rewrite("helpers")  # tests/helpers/: their asserts report values as a test's do


@pytest.fixture(scope="session", autouse=True)
def _test_cache():
    yield
    shutil.rmtree(os.environ["INSTAR_CACHE"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A dense tiny Qwen3 with the ChatML tool template (path to an HF checkpoint directory)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec())


@pytest.fixture(scope="session")
def tiny_heads4_dir(tmp_path_factory):
    """A dense tiny Qwen3 with 4 attention heads and 2 key/value heads: both split over 2 tp or cp ranks."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_heads4"), TinySpec(heads=4, kv_heads=2))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE: 4 experts, top-2, every layer sparse."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), TinySpec(moe=True))


@pytest.fixture(scope="session")
def prompts(tmp_path_factory):
    """40 arithmetic prompts with labels, for end-to-end runs (JSONL path)."""
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i}*7+3?", "label": str(i * 7 + 3)}) + "\n"
                            for i in range(40)))
    return str(path)


@pytest.fixture
def clusters(monkeypatch):
    """Every Cluster the run starts, to reach its actors."""
    started: list = []
    from instar.runtime.cluster import Cluster

    enter = Cluster.__aenter__

    async def record(self):
        started.append(await enter(self))
        return self

    monkeypatch.setattr(Cluster, "__aenter__", record)
    return started


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A tiny Qwen3-VL (one vision block, one deepstack level) with its image processor."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_vlm"), TinySpec(vlm=True))


@pytest.fixture
def ray_cluster():
    """A local Ray instance for the test, shut down whatever happens."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def scripted(tmp_path_factory):
    """The tiny model fine-tuned to replay helpers.agents.SCRIPT (``.path``) and its tokenizer (``.tokenizer``)."""
    from helpers.agents import scripted_model_dir
    from transformers import AutoTokenizer

    path = scripted_model_dir(tmp_path_factory)
    return SimpleNamespace(path=path, tokenizer=AutoTokenizer.from_pretrained(path))


@pytest.fixture(scope="module")
def dense(tiny_model_dir):
    """The dense tiny model in HF transformers (eval mode), the engines' reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()

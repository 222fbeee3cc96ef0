"""The vLLM tier: integration tests of `instar.engines.vllm` on vLLM's CPU build, in .venv-vllm.

`make test-vllm` sets INSTAR_REQUIRE_VLLM=1: a missing vllm is then an error, never a skip (CI runs
it after `make test`). Elsewhere (the main .venv) the modules that need vllm skip with a visible
reason. Each module starts one engine (`vllm_tier.start_engine`) and always shuts it down.
"""

import json
import os
import shutil

import pytest
from vllm_tier import HAVE_VLLM, cpu_isa

from instar.data.tiny_model import TinySpec, build_tiny_model

if os.environ.get("INSTAR_REQUIRE_VLLM") == "1" and not HAVE_VLLM:
    raise pytest.UsageError("INSTAR_REQUIRE_VLLM=1 but vllm is not importable in this interpreter; "
                            "run `make test-vllm` (it sets up .venv-vllm with scripts/setup_vllm.sh)")


def pytest_report_header(config):
    return f"cpu instruction set (vLLM's CPU kernels are chosen by it): {cpu_isa()}"


# A checkpoint generation_config that would change every sample if it leaked into vLLM's sampling.
HOSTILE_GENERATION_CONFIG = {"do_sample": True, "temperature": 0.05, "top_k": 1, "top_p": 0.1,
                             "repetition_penalty": 3.0, "max_new_tokens": 2, "eos_token_id": [1, 2, 3]}


@pytest.fixture(scope="session")
def vllm_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a hostile generation_config.json (see HOSTILE_GENERATION_CONFIG)."""
    out = tmp_path_factory.mktemp("tiny_vllm")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    (out / "generation_config.json").write_text(json.dumps(HOSTILE_GENERATION_CONFIG))
    return out


@pytest.fixture(scope="session")
def model_b_dir(tmp_path_factory):
    """Same shapes and tokenizer as the tiny model, other random weights (seed 1): a weight update."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_b"), TinySpec(seed=1))

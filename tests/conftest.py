"""Shared fixtures: tiny models built once per test session, one compute thread per process."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: 2 cores are shared

import pytest
import torch

from instar.data.tiny_model import TinySpec, build_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A dense tiny Qwen3 with the ChatML tool template (path to an HF checkpoint directory)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec())


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE: 4 experts, top-2, every layer sparse."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), TinySpec(moe=True))

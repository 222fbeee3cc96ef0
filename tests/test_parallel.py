"""Tensor parallelism over gloo equals one rank: tp=2 and tp=2 x dp=2 give the same logprobs, loss,
grad norm and weights as a single rank after 3 steps; a checkpoint saved in one layout resumes in
another (DCP reshards) to the same next step; impossible layouts are refused naming the fix."""

import pytest
from helpers.layouts import check_equals_one_rank, make_sample, rl_two_steps, train_job

from instar.checks import check_layout
from instar.config import ConfigError, FSDPConfig
from instar.train.launch import reserve_port

LENGTHS = [7, 12, 5, 9, 3, 10, 4, 8]
SAMPLES = [make_sample(n, i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def model_dir(tiny_heads4_dir):
    return tiny_heads4_dir


@pytest.fixture(scope="module")
def one_rank(model_dir):
    return train_job(0, 1, reserve_port(), model_dir, {}, SAMPLES, None)


@pytest.mark.parametrize("world, fsdp, other", [(2, {"tp_size": 2}, {}), (4, {"tp_size": 2}, {"tp_size": 2})],
                         ids=["tp2", "tp2xdp2"])
def test_tensor_parallel_equals_one_rank(model_dir, one_rank, tmp_path, world, fsdp, other):
    check_equals_one_rank(model_dir, SAMPLES, one_rank, world, fsdp, other, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("fsdp, heads, fragment", [
    (FSDPConfig(num_ranks=3, tp_size=2), None, "must be a multiple of --fsdp.tp_size x --fsdp.cp_size = 2"),
    (FSDPConfig(num_ranks=2, tp_size=2), (4, 1), "must divide the model's attention heads (4) and key/value heads (1)"),
    (FSDPConfig(num_ranks=2, tp_size=0), None, "--fsdp.tp_size must be >= 1"),
    (FSDPConfig(num_ranks=4, tp_size=2, cp_size=2), (2, 2), "--fsdp.cp_size 2 must divide the 1 attention heads"),
])
def test_impossible_layouts_name_the_fix(fsdp, heads, fragment):
    model = None if heads is None else type("Config", (), {"num_attention_heads": heads[0],
                                                            "num_key_value_heads": heads[1]})()
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_layout(fsdp, model)


@pytest.mark.slow
def test_rl_runs_two_steps_with_tensor_parallel_ranks(tmp_path, model_dir):
    """The whole loop with --fsdp.num_ranks 2 --fsdp.tp_size 2: the engine gets full weights from the
    sharded trainer, so its logprobs equal the trainer's at every step of a strictly on-policy run."""
    metrics = rl_two_steps(tmp_path, model_dir, num_ranks=2, tp_size=2)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(abs(m["actor/vllm_kl"]) < 1e-3 for m in metrics)  # step 2 samples with the synced weights
    assert metrics[0]["actor/grad_norm"] > 0 and (tmp_path / "run/hf/model.safetensors").exists()


def test_context_parallel_repeats_key_value_heads_that_do_not_divide():
    model = type("Config", (), {"num_attention_heads": 4, "num_key_value_heads": 1})()
    check_layout(FSDPConfig(num_ranks=2, cp_size=2), model)  # 1 key/value head: each cp rank gets a copy

"""Tensor parallelism and hybrid sharding over gloo equal one rank: tp=2, tp=2 x dp=2 and HSDP 2 x 2 give the
same logprobs, loss, grad norm and weights as a single rank after 3 steps; a checkpoint saved in one layout
resumes in another (DCP reshards) to the same next step; impossible layouts are refused naming the fix."""

import pytest
from helpers.layouts import check_equals_one_rank, make_sample, make_worker, rl_two_steps, train_job
from torch.distributed.tensor import Replicate, Shard

from instar.checks import check_layout
from instar.config import ConfigError, FSDPConfig
from instar.train.launch import reserve_port, run_ranks

LENGTHS = [7, 12, 5, 9, 3, 10, 4, 8]
SAMPLES = [make_sample(n, i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def model_dir(tiny_heads4_dir):
    return tiny_heads4_dir


@pytest.fixture(scope="module")
def one_rank(model_dir):
    return train_job(0, 1, reserve_port(), model_dir, {}, SAMPLES, None)


@pytest.mark.parametrize("world, fsdp, other", [(2, {"tp_size": 2}, {}), (4, {"tp_size": 2}, {"tp_size": 2}),
                                                (4, {"replicate_size": 2}, {"replicate_size": 2}),
                                                (4, {"tp_size": 2, "replicate_size": 2}, {"tp_size": 2})],
                         ids=["tp2", "tp2xdp2", "hsdp2x2", "tp2xhsdp2"])
def test_tensor_parallel_and_hybrid_sharding_equal_one_rank(model_dir, one_rank, tmp_path, world, fsdp, other):
    # hsdp2x2: two replicas of a model sharded over two ranks; it resumes into two replicas of one rank each
    check_equals_one_rank(model_dir, SAMPLES, one_rank, world, fsdp, other, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("fsdp, heads, fragment", [
    (FSDPConfig(num_ranks=3, tp_size=2), None, "must be a multiple of --fsdp.tp_size x --fsdp.cp_size = 2"),
    (FSDPConfig(num_ranks=2, tp_size=2), (4, 1), "must divide the model's attention heads (4) and key/value heads (1)"),
    (FSDPConfig(num_ranks=2, tp_size=0), None, "--fsdp.tp_size must be >= 1"),
    (FSDPConfig(num_ranks=4, tp_size=2, cp_size=2), (2, 2), "--fsdp.cp_size 2 must divide the 1 attention heads"),
    (FSDPConfig(num_ranks=4, replicate_size=3), None,
     "--fsdp.replicate_size 3 must divide the data-parallel ranks outside expert parallelism (--fsdp.num_ranks / "
     "(tp x cp x ep) = 4)"),
    (FSDPConfig(num_ranks=4, ep_size=4, replicate_size=2), None, "--fsdp.replicate_size 2 must divide"),
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


def _mesh_job(rank, world, port, model_dir):
    w = make_worker(model_dir, rank, world, port, {"replicate_size": 2})
    param = next(w.policy.parameters())
    out = param.device_mesh.mesh_dim_names, param.placements, param.to_local().shape[0], param.shape[0]
    w.shutdown()
    return out


def test_hybrid_sharding_replicates_over_the_groups_and_shards_within(model_dir):
    for names, placements, local_rows, rows in run_ranks(_mesh_job, 4, model_dir, timeout=300):
        assert names == ("rep", "dp") and placements == (Replicate(), Shard(0)) and local_rows == rows // 2


@pytest.mark.slow
def test_rl_runs_two_steps_with_hybrid_sharded_ranks(tmp_path, model_dir):
    """--fsdp.num_ranks 2 --fsdp.replicate_size 2: the weight sync gathers from the (rep, shard) mesh."""
    metrics = rl_two_steps(tmp_path, model_dir, num_ranks=2, replicate_size=2)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(abs(m["actor/vllm_kl"]) < 1e-3 for m in metrics)


def test_context_parallel_repeats_key_value_heads_that_do_not_divide():
    model = type("Config", (), {"num_attention_heads": 4, "num_key_value_heads": 1})()
    check_layout(FSDPConfig(num_ranks=2, cp_size=2), model)  # 1 key/value head: each cp rank gets a copy

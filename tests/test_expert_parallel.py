"""Expert parallelism over gloo equals one rank: ep=2 (and ep=2 x dp=2) give the same logprobs, loss,
grad norm and weights as a single rank after 3 steps on the tiny MoE; routing replay (R3) and frozen
routers work unchanged under EP; a checkpoint saved with EP resumes in another layout to the same
next step; impossible layouts are refused naming the fix."""


from functools import partial

import pytest
import torch
from helpers.layouts import TOL, check_equals_one_rank, full, make_sample, make_worker, rl_two_steps, step, train_job
from helpers.routes import record_routes

from instar.checks import check_layout
from instar.config import ConfigError, FSDPConfig
from instar.train.launch import reserve_port, run_ranks
from instar.train.model import forward_logits
from instar.train.moe import replay_routes, routers

LENGTHS = [7, 12, 5, 9, 3, 10, 4, 8]
# R3 routes unlike the router's own: 2 distinct of the 4 experts per token and layer, at random
SAMPLES = [make_sample(n, i, torch.rand(n, 2, 4, generator=torch.Generator().manual_seed(100 + i)).argsort(-1)[..., :2])
           for i, n in enumerate(LENGTHS)]


def _replay_job(rank, world, port, model_dir, ep):
    """Logprobs under R3, and what the routers chose while replaying this rank's own samples (every
    rank runs as many forwards: the all-to-alls pair them up), then a step with frozen routers."""
    w = make_worker(model_dir, rank, world, port, {"ep_size": ep}, replay=True)
    out = {"logprobs": w.compute_logprobs(SAMPLES), "recorded": []}
    for s in SAMPLES[rank::world]:
        ids = torch.tensor([s.token_ids])
        with torch.no_grad(), replay_routes(w.policy, s.routed_experts), record_routes(w.policy) as rec:
            forward_logits(w.policy, ids, torch.arange(ids.shape[1])[None])
        out["recorded"].append((s.routed_experts, rec[0]))
    gates = [full(r.weight).clone() for r in routers(w.policy)]
    out["metrics"] = step(w, SAMPLES)
    out["routers_frozen"] = all(torch.equal(full(r.weight), g) for r, g in zip(routers(w.policy), gates))
    out["after"] = w.compute_logprobs(SAMPLES)
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def one_rank(tiny_moe_dir):
    return train_job(0, 1, reserve_port(), tiny_moe_dir, {}, SAMPLES, None)


@pytest.mark.parametrize("world, fsdp, other", [(2, {"ep_size": 2}, {}), (4, {"ep_size": 2}, {"ep_size": 2}),
                                                (4, {"ep_size": 2, "replicate_size": 2}, {})],
                         ids=["ep2", "ep2xdp2", "ep2xhsdp2"])
def test_expert_parallel_equals_one_rank(tiny_moe_dir, one_rank, tmp_path, world, fsdp, other):
    # ep=2 x dp=2 resumes at ep=2 on 2 ranks, ep=2 at dp=2: the experts change hands either way
    check_equals_one_rank(tiny_moe_dir, SAMPLES, one_rank, world, fsdp, other, str(tmp_path / "ckpt"))


def test_routing_replay_and_frozen_routers_under_expert_parallel(tiny_moe_dir):
    want = _replay_job(0, 1, reserve_port(), tiny_moe_dir, 1)
    results = run_ranks(_replay_job, 2, tiny_moe_dir, 2, timeout=600)
    for r in results:
        for replayed, recorded in r["recorded"]:
            assert torch.equal(recorded, replayed)  # the experts that ran are exactly the replayed ones
        assert r["routers_frozen"]
        for got, ref in zip(r["logprobs"] + r["after"], want["logprobs"] + want["after"], strict=True):
            torch.testing.assert_close(got, ref, **TOL)
        assert r["metrics"]["actor/grad_norm"] == pytest.approx(want["metrics"]["actor/grad_norm"], rel=1e-4)
    # the replayed routes are not the router's own: without replay the logprobs differ
    assert max((a - b).abs().max() for a, b in zip(want["logprobs"], _own_routes(tiny_moe_dir))) > 1e-3


def _own_routes(model_dir) -> list[torch.Tensor]:
    w = make_worker(model_dir, 0, 1, reserve_port(), {})
    try:
        return w.compute_logprobs(SAMPLES)
    finally:
        w.shutdown()


@pytest.mark.parametrize("fsdp, experts, fragment", [
    (FSDPConfig(num_ranks=2, ep_size=2), 3, "--fsdp.ep_size 2 must divide the model's experts (3)"),
    (FSDPConfig(num_ranks=2, ep_size=2), None, "must divide the model's experts (none: a dense model)"),
    (FSDPConfig(num_ranks=3, ep_size=2), 4, "--fsdp.ep_size 2 must divide the data-parallel ranks"),
    (FSDPConfig(num_ranks=4, ep_size=4, tp_size=2), 4, "use --fsdp.num_ranks 8 or a smaller --fsdp.ep_size"),
])
def test_impossible_expert_layouts_name_the_fix(fsdp, experts, fragment):
    model = type("Config", (), {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": experts})()
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_layout(fsdp, model)


@pytest.mark.slow
def test_rl_runs_two_steps_with_expert_parallel_ranks(tmp_path, tiny_moe_dir):
    """The whole loop with --fsdp.num_ranks 2 --fsdp.ep_size 2: the engine gets full HF-named expert
    weights from the sharded trainer, so its logprobs equal the trainer's at every step of a strictly
    on-policy run."""
    metrics = rl_two_steps(tmp_path, tiny_moe_dir, num_ranks=2, ep_size=2)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(abs(m["actor/vllm_kl"]) < 1e-3 for m in metrics)  # step 2 samples with the synced weights
    assert metrics[0]["actor/grad_norm"] > 0 and (tmp_path / "run/hf/model.safetensors").exists()


def test_expert_and_context_parallel_together_equal_one_rank(tmp_path_factory, tmp_path):
    """ep=2 x cp=2 on 4 ranks (a MoE model with 4 heads: Ulysses splits them over the context ranks)."""
    from instar.data.tiny_model import TinySpec, build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("moe_heads4"), TinySpec(moe=True, heads=4, kv_heads=2))
    one_rank = train_job(0, 1, reserve_port(), model, {}, SAMPLES, None)
    check_equals_one_rank(model, SAMPLES, one_rank, 4, {"ep_size": 2, "cp_size": 2}, {"cp_size": 2},
                          str(tmp_path / "ckpt"))


def test_grouped_experts_equal_the_per_expert_loop_forward_and_backward():
    """transformers' grouped_mm experts (what instar trains with at ep 1) and instar's dispatch (its ep > 1 path,
    here over one rank) equal transformers' per-expert loop: outputs, input and weight gradients. Tokens route to
    only some of the experts: the others must get zero gradients, not none."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from instar.train.expert_parallel import apply_expert_parallel, dispatch_and_combine

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    hidden, grad = torch.randn(24, 32), torch.randn(24, 32)
    weights, index = torch.randn(24, 8)[:, :6].softmax(-1).topk(2)  # experts 6 and 7 get no token
    reference = Qwen3MoeExperts(config)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = []
        for impl in ("eager", "grouped_mm", "instar"):
            experts = Qwen3MoeExperts(config)
            experts.load_state_dict(reference.state_dict())
            experts.config._experts_implementation = "grouped_mm" if impl == "instar" else impl
            if impl == "instar":
                apply_expert_parallel(torch.nn.Sequential(experts), init_device_mesh("cpu", (1,)))
            x = hidden.clone().requires_grad_()
            out = (partial(dispatch_and_combine, experts, dist.group.WORLD) if impl == "instar" else experts)(
                x, index, weights)
            out.backward(grad)
            results.append([out, x.grad, *(full(p.grad) for p in experts.parameters())])
    finally:
        dist.destroy_process_group()
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert results[2][2][6:].abs().sum() == 0 and results[2][2][:6].abs().sum() > 0

"""LoRA (--actor.lora_*): the adapted policy equals a hand-written LoRA of the base model (values and
gradients), only adapters train and are checkpointed, two FSDP2 ranks train like one (and resume across rank
counts), the reference is the base with the adapters off, the engines get merged weights, and an export loads
in PEFT. Bad settings are one line."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.layouts import TOL, full, full_state, make_sample, step
from helpers.loop import make_cfg, rows
from torch.func import functional_call
from transformers import AutoModelForCausalLM

from instar.checks import check_lora
from instar.config import ActorConfig, ConfigError, FSDPConfig, TrainConfig
from instar.train import checkpoint, lora
from instar.train.launch import reserve_port, run_ranks
from instar.train.model import forward_logits, next_token_logprobs
from instar.train.worker import TrainWorker

RANK, ALPHA = 4, 8
SAMPLES = [make_sample(n, i) for i, n in enumerate([13, 9, 17, 11])]


def logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Of tokens 1.. of the row ``ids [1, N]``: what `TrainWorker.compute_logprobs` gives from index 1."""
    return next_token_logprobs(logits, ids, with_entropy=False)[0][:-1]


def lora_worker(model_dir, rank: int = 0, world: int = 1, port: int | None = None, ref: bool = False,
                **actor) -> TrainWorker:
    settings = {"lora_rank": RANK, "lora_alpha": ALPHA, "learning_rate": 1e-2, **actor}
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir), **settings), FSDPConfig(num_ranks=world),
                    TrainConfig(max_tokens_per_gpu=24, max_steps=10), ref_path=str(model_dir) if ref else None)
    try:
        w.init(rank, world, "127.0.0.1", port or reserve_port())
    except Exception:
        w.shutdown()  # a failed start must not leave this process's group to the next test
        raise
    return w


def adapters(w: TrainWorker) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in w.policy.named_parameters() if lora.is_adapter(n)}


def base_model(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def randomise_b(w: TrainWorker) -> None:
    """B starts at zero (the policy starts as its base): give it values so the adapters change the model."""
    with torch.no_grad():
        for name, p in w.policy.named_parameters():
            if ".lora_B." in name:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(torch.randn(local.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)


def test_lora_equals_hand_written_lora(tiny_model_dir):
    """Logprobs and adapter gradients of the PEFT policy equal W x + (alpha / r) B A x written by hand over the
    base model's own weights (torch.func.functional_call), on every targeted layer."""
    w = lora_worker(tiny_model_dir)
    randomise_b(w)
    ids = torch.tensor([SAMPLES[0].token_ids])
    positions = torch.arange(ids.shape[1])[None]
    logp = logprobs(forward_logits(w.policy, ids, positions), ids)
    logp.sum().backward()
    grads = {n: full(p.grad) for n, p in w.policy.named_parameters() if lora.is_adapter(n)}
    values = adapters(w)
    w.shutdown()

    base = base_model(tiny_model_dir)
    leaves = {n: v.clone().requires_grad_(True) for n, v in values.items()}
    layers = {n.split(".lora_")[0] for n in leaves}
    assert len(layers) == 7 * base.config.num_hidden_layers  # all-linear: q k v o gate up down, not the head
    params = dict(base.named_parameters())
    for layer in layers:
        a, b = leaves[f"{layer}.lora_A.default.weight"], leaves[f"{layer}.lora_B.default.weight"]
        params[f"{layer}.weight"] = params[f"{layer}.weight"] + (ALPHA / RANK) * b @ a
    want = logprobs(functional_call(base, params, (ids,), {"position_ids": positions}).logits, ids)
    torch.testing.assert_close(logp.detach(), want.detach(), **TOL)
    want.sum().backward()
    for name, leaf in leaves.items():
        torch.testing.assert_close(grads[name], leaf.grad, **TOL, msg=name)


def test_only_adapters_train_and_the_reference_is_the_base(tiny_model_dir):
    """The optimizer holds the adapters alone; a step moves them and nothing else; the reference logprobs come
    from the same model with adapters off and equal a separately loaded base model's; the engines get the
    targeted layers' merged weights under HF names, which make a plain model compute the policy."""
    w = lora_worker(tiny_model_dir, ref=True)
    assert w.ref is None and w.ref_is_base  # no second copy
    trainable = [n for n, p in w.policy.named_parameters() if p.requires_grad]
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    assert sum(len(g["params"]) for g in w.optimizer.param_groups) == len(trainable)
    before = {k: v.clone() for k, v in full_state(w).items()}  # on one CPU rank it is the model's own memory
    step(w, SAMPLES)
    after = {k: v.clone() for k, v in full_state(w).items()}
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {k for k in before if ".lora_B." in k}  # B moved off zero; A gets no gradient while B = 0
    step(w, SAMPLES)
    assert not torch.equal(after[next(k for k in after if ".lora_A." in k)], full_state(w)[next(
        k for k in after if ".lora_A." in k)])

    ref = w.compute_logprobs(SAMPLES, model="ref")
    policy = w.compute_logprobs(SAMPLES)
    base = base_model(tiny_model_dir)
    merged = dict(lora.merged_weights(w.policy))
    w.shutdown()
    with torch.no_grad():
        for got, sample in zip(ref, SAMPLES):
            ids = torch.tensor([sample.token_ids])
            torch.testing.assert_close(got[1:], logprobs(base(ids).logits, ids), **TOL)
        assert not torch.allclose(policy[0], ref[0], atol=1e-4)  # the adapters did change the policy
        assert set(merged) == {k.replace(".base_layer.", ".") for k in before if ".base_layer." in k}
        base.load_state_dict(merged, strict=False)
        for got, sample in zip(policy, SAMPLES):
            ids = torch.tensor([sample.token_ids])
            torch.testing.assert_close(got[1:], logprobs(base(ids).logits, ids), **TOL)


def lora_job(rank, world, port, model_dir, ckpt_dir, resume: bool) -> dict:
    """Two steps (a checkpoint after the first), or, with ``resume``, the second step from that checkpoint."""
    w = lora_worker(model_dir, rank, world, port)
    if resume:
        w.load(checkpoint.latest(ckpt_dir))
    else:
        step(w, SAMPLES)
        w.save(ckpt_dir)
    out = {"metrics": step(w, SAMPLES), "adapters": adapters(w), "logprobs": w.compute_logprobs(SAMPLES)}
    w.shutdown()
    return out


@pytest.mark.slow
def test_two_lora_ranks_equal_one_and_resume_across_rank_counts(tiny_model_dir, tmp_path):
    """FSDP2 over two ranks trains the adapters as one rank does; its checkpoint holds only the adapters and their
    optimizer state, and resumes at one rank to the same second step."""
    one = lora_job(0, 1, reserve_port(), tiny_model_dir, str(tmp_path / "one"), False)
    two = run_ranks(lora_job, 2, tiny_model_dir, str(tmp_path / "two"), False, timeout=600)
    resumed = lora_job(0, 1, reserve_port(), tiny_model_dir, str(tmp_path / "two"), True)
    saved = dcp.FileSystemReader(checkpoint.latest(str(tmp_path / "two"))).read_metadata().state_dict_metadata
    tensors = [k for k in saved if not k.startswith("policy.optim.param_groups.")]  # hyper-parameters, not tensors
    assert tensors and all(".lora_" in k for k in tensors), [k for k in tensors if ".lora_" not in k]
    for got in (two[0], two[1], resumed):
        assert got["metrics"]["actor/loss"] == pytest.approx(one["metrics"]["actor/loss"], rel=1e-4, abs=1e-6)
        for k, v in one["adapters"].items():
            torch.testing.assert_close(got["adapters"][k], v, **TOL, msg=k)
        for a, b in zip(got["logprobs"], one["logprobs"]):
            torch.testing.assert_close(a, b, **TOL)


def test_export_is_a_peft_adapter_folder(tiny_model_dir, tmp_path):
    """The default export loads with peft.PeftModel.from_pretrained over the base and computes the policy; the
    merged export (--actor.lora_merged_export) is a plain HF model that computes it too."""
    from peft import PeftModel

    w = lora_worker(tiny_model_dir)
    randomise_b(w)
    policy = w.compute_logprobs(SAMPLES[:1])[0][1:]
    w.export_hf(str(tmp_path / "adapter"))
    w.actor.lora_merged_export = True
    w.export_hf(str(tmp_path / "merged"))
    w.shutdown()
    saved = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert saved["r"] == RANK and saved["lora_alpha"] == ALPHA and "q_proj" in saved["target_modules"]
    ids = torch.tensor([SAMPLES[0].token_ids])
    peft_model = PeftModel.from_pretrained(base_model(tiny_model_dir), str(tmp_path / "adapter")).eval()
    merged = base_model(tmp_path / "merged")
    with torch.no_grad():
        for model in (peft_model, merged):
            torch.testing.assert_close(logprobs(model(ids).logits, ids), policy, **TOL)


@pytest.mark.slow
def test_rl_with_lora_samples_the_current_policy(tmp_path, tiny_model_dir, prompts):
    """`instar rl --actor.lora_rank 8` strictly on-policy with a KL reference: after each merged-weight sync the
    engine's logprobs equal the trainer's (vllm_kl < 1e-3), and the reference is the adapters-off base (its KL is
    0 at step 1, when the adapters are still zero)."""
    from instar.loop import run

    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{"train.force_sync_mode": True, "train.max_steps": 3,
                                                          "actor.lora_rank": 8, "actor.learning_rate": 1e-2})
    cfg.algo.kl.coef = 0.01
    run(cfg)
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(abs(m["actor/vllm_kl"]) < 1e-3 for m in metrics), metrics
    assert metrics[0]["actor/ref_kl"] == pytest.approx(0, abs=1e-7) and metrics[2]["actor/ref_kl"] != 0

    # a new run from the adapter that run exported: the engines get the adapted weights before they sample
    cfg.actor.lora_rank, cfg.actor.lora_path = 0, str(tmp_path / "run/hf")
    cfg.train.max_steps, cfg.ckpt.output_dir = 1, str(tmp_path / "again")
    run(cfg)
    again = rows(tmp_path / "again/metrics.jsonl")[0]
    assert abs(again["actor/vllm_kl"]) < 1e-3 and again["actor/ref_kl"] != 0, again


@pytest.mark.parametrize("change, message", [
    ({"lora_rank": -1}, "--actor.lora_rank must be a positive integer"),
    ({"lora_rank": 4, "lora_dropout": 1.0}, "--actor.lora_dropout in [0, 1)"),
    ({"lora_rank": 4, "model_backend": "automodel"}, "needs --actor.model_backend hf"),
])
def test_bad_lora_settings_are_one_line(change, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check_lora(ActorConfig(**change), FSDPConfig())


@pytest.mark.parametrize("layout", ["tp_size", "ep_size", "cp_size"])
def test_lora_refuses_model_parallel_layouts(layout):
    with pytest.raises(ConfigError, match=f"set --fsdp.{layout} 1"):
        check_lora(ActorConfig(lora_rank=4), FSDPConfig(num_ranks=2, **{layout: 2}))


def test_target_modules_that_match_nothing_name_what_exists(tiny_model_dir):
    with pytest.raises(ValueError, match="matches no layer of the model; its linear layers are named .*q_proj"):
        lora_worker(tiny_model_dir, lora_target_modules=["qproj"])


def test_sft_with_lora_learns_and_exports_an_adapter(tiny_model_dir, tmp_path):
    """`instar sft --actor.lora_rank 8`: the held-out loss falls, and the run's export is an adapter folder."""
    from instar.config import CkptConfig, SFTConfig, SFTSection
    from instar.train.sft import run_sft

    task = [{"messages": [{"role": "user", "content": f"echo {a}"}, {"role": "assistant", "content": f"It is {a}."}]}
            for a in range(10, 90)]
    (tmp_path / "task.jsonl").write_text("".join(json.dumps(t) + "\n" for t in task))
    cfg = SFTConfig(actor=ActorConfig(model_name_or_path=str(tiny_model_dir), learning_rate=1e-2, lora_rank=8),
                    sft=SFTSection(dataset=str(tmp_path / "task.jsonl"), batch_size=16, epochs=3, eval_fraction=0.2,
                                   max_tokens_per_gpu=128), fsdp=FSDPConfig(num_ranks=1),
                    ckpt=CkptConfig(output_dir=str(tmp_path / "out")))
    last = run_sft(cfg)
    first = json.loads((tmp_path / "out/metrics.jsonl").read_text().splitlines()[0])
    # the head and embeddings stay random and frozen, so adapters learn slower than full training does here
    assert last["eval/loss"] < first["eval/loss"] - 0.5, (first, last)
    assert (tmp_path / "out/hf/adapter_model.safetensors").exists()
    assert not (tmp_path / "out/hf/model.safetensors").exists()


def test_a_bfloat16_base_under_float32_adapters(tiny_model_dir):
    """--actor.lora_base_dtype bfloat16: the frozen base is held in bfloat16, the adapters and their AdamW moments
    in float32, FSDP2 trains them together, and the merged weights the engines get are the base's dtype."""
    w = lora_worker(tiny_model_dir, lora_base_dtype="bfloat16")
    dtypes = {n: p.dtype for n, p in w.policy.named_parameters()}
    assert {d for n, d in dtypes.items() if lora.is_adapter(n)} == {torch.float32}
    assert {d for n, d in dtypes.items() if not lora.is_adapter(n)} == {torch.bfloat16}
    metrics = step(w, SAMPLES)
    assert metrics["actor/grad_norm"] > 0
    assert {v.dtype for s in w.optimizer.state.values() for v in s.values() if v.ndim} == {torch.float32}
    assert {t.dtype for _, t in lora.merged_weights(w.policy)} == {torch.bfloat16}
    w.shutdown()


@pytest.mark.parametrize("argv, targets", [
    ([], "all-linear"), (["--actor.lora_target_modules", "[q_proj,v_proj]"], ["q_proj", "v_proj"]),
    (["--actor.lora_target_modules", "q_proj"], "q_proj")])
def test_lora_flags_parse(argv, targets, tiny_model_dir):
    """The flags as a user types them; one module name adapts that layer alone."""
    from instar.cli.main import parse

    _, cfg = parse(["sft", "--actor.lora_rank", "8", *argv])
    assert (cfg.actor.lora_rank, cfg.actor.lora_target_modules) == (8, targets)
    if targets == "q_proj":
        w = lora_worker(tiny_model_dir, lora_target_modules=targets)
        adapted = {n.split(".lora_")[0].rpartition(".")[2] for n, _ in w.policy.named_parameters() if ".lora_" in n}
        w.shutdown()
        assert adapted == {"q_proj"}


def test_a_run_starts_from_a_saved_adapter(tiny_model_dir, tiny_heads4_dir, tmp_path):
    """--actor.lora_path: the adapters, rank and alpha of an exported adapter folder; one that was trained on
    another model, or a folder that holds none, is one line."""
    w = lora_worker(tiny_model_dir, lora_rank=2, lora_alpha=6)
    randomise_b(w)
    policy = w.compute_logprobs(SAMPLES)
    w.export_hf(str(tmp_path / "adapter"))
    w.shutdown()
    w = lora_worker(tiny_model_dir, lora_rank=0, lora_path=str(tmp_path / "adapter"))
    assert (w.actor.lora_rank, w.actor.lora_alpha) == (2, 6)
    for got, want in zip(w.compute_logprobs(SAMPLES), policy):
        torch.testing.assert_close(got, want, **TOL)
    w.shutdown()
    with pytest.raises(ValueError, match="does not fit the model: model.layers.0"):
        lora_worker(tiny_heads4_dir, lora_path=str(tmp_path / "adapter"))
    with pytest.raises(ConfigError, match="is not a PEFT adapter folder"):
        check_lora(ActorConfig(lora_path=str(tiny_model_dir)), FSDPConfig())

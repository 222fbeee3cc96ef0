"""The RL loop end to end on CPU: Ray actors, embedded engines, agent runners, FSDP2 trainer ranks,
weight sync, checkpoints. Every test runs the real topology on the tiny model."""

import json
import re

import pytest
import torch
from helpers.loop import ROOT, make_cfg, rows
from safetensors.torch import load_file

from instar.cli.main import main
from instar.cli.view import write_view
from instar.config import AdvantageConfig
from instar.contract import read_jsonl
from instar.loop import run

pytestmark = pytest.mark.slow


def test_sync_mode_two_engines_two_ranks(tmp_path, tiny_model_dir, prompts, monkeypatch):
    # with the CPU accelerator: both engines build into an empty cache at once
    monkeypatch.setenv("INSTAR_CACHE", str(tmp_path / "cache"))
    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{"train.force_sync_mode": True, "engine.num_engines": 2,
                                                          "fsdp.num_ranks": 2, "engine.enable_sleep_mode": True,
                                                          "cpu.enable": True})
    run(cfg)
    built = sorted(p.suffix if p.suffix == ".pt2" else p.name.split("-", 1)[1]
                   for p in (tmp_path / "cache/cpu").iterdir())
    # one build each of the engine's two halves and head, its decode kernel and the trainer's attention kernel, no
    # leftovers
    assert built == [".pt2", ".pt2", ".pt2", "attention.so", "decode.so"]
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert abs(metrics[0]["actor/vllm_kl"]) < 1e-3  # on-policy: engine and trainer agree
    assert all(m["staleness_max"] == 0 for m in metrics)  # strictly on-policy
    assert all(m["trajectories"] == 8 for m in metrics)
    assert metrics[0]["actor/grad_norm"] > 0
    assert all(m["engine/idle_fraction"] <= 1 and m["agent/cpu_fraction"] > 0 for m in metrics)
    assert all(1 <= m["engine/rows_per_step"] <= 8 and m["engine/step_ms"] > 0 for m in metrics)
    assert all(m["engine/sleeps"] == 1 for m in metrics)  # each engine slept once a step, while the trainer ran
    ledger = rows(tmp_path / "run/ledger.jsonl")
    trained = [(r["epoch"], r["prompt_index"]) for r in ledger if r["outcome"] == "trained"]
    assert len(trained) == 6 == len(set(trained))
    assert (tmp_path / "run/hf/model.safetensors").exists()


def test_a_run_whose_every_rollout_fails_stops_saying_why(tmp_path, tiny_model_dir, prompts, capfd):
    """No batch to train on, ever: the run ends after --train.max_barren_batches batches, naming the drops."""
    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{"train.agent_path": str(ROOT / "tests/agents/broken_env.py"),
                                                         "train.max_barren_batches": 2})
    with pytest.raises(RuntimeError, match=r"2 rollout batches in a row left nothing to train on .*"
                                           r"agent/dropped_error_ValueError"):
        run(cfg)
    assert "step 1: nothing to train on in batch 1 in a row" in capfd.readouterr().err
    assert not (tmp_path / "run" / "hf").exists()


def test_async_partial_rollout_mixes_versions(tmp_path, tiny_model_dir, prompts):
    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{
        "train.async_queue_size": 2, "train.partial_rollout_enable": True, "engine.num_engines": 2,
        "fsdp.num_ranks": 2, "rollout.vllm_generate_batch_size": 8, "data.max_new_tokens": 320,
        "data.max_len": 1024, "train.rollout_dump_dir": str(tmp_path / "dump"), "train.max_steps": 6})
    run(cfg)
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert max(m["staleness_max"] for m in metrics) >= 1  # generation ran ahead of training
    mixed = [t for f in sorted((tmp_path / "dump").iterdir()) for t in read_jsonl(str(f))
             if len({v for s in t.segments for v, m in zip(s.versions, s.action_mask) if m}) > 1]
    assert mixed, "no trajectory was paused mid-generation across a weight sync"


def test_replaying_a_dump_reproduces_the_step(tmp_path, tiny_model_dir, prompts):
    """The replayed step equals the original to the bit; replayed with the CPU accelerator (its attention kernel,
    oneDNN or BLAS), within float32 rounding."""
    first = make_cfg(tmp_path / "a", tiny_model_dir, prompts, **{
        "train.force_sync_mode": True, "train.max_steps": 1, "train.rollout_dump_dir": str(tmp_path / "dump")})
    run(first)
    for out, accelerated in (("b", False), ("c", True)):
        run(make_cfg(tmp_path / out, tiny_model_dir, prompts, **{
            "train.force_sync_mode": True, "train.max_steps": 1, "train.rollout_replay_dir": str(tmp_path / "dump"),
            "cpu.enable": accelerated}))
    a, b, c = (rows(tmp_path / f"{out}/run/metrics.jsonl")[0] for out in "abc")
    assert a["actor/loss"] != 0
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy", "advantage_abs_mean", "reward"):
        assert a[key] == b[key], key
        assert c[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    page = write_view(tmp_path / "dump", str(tiny_model_dir)).read_text()  # `instar view` reads real dumps
    # one span per sampled token, or per character whose bytes several sampled tokens carry (its ids listed)
    spans = re.findall(r"<span class=a [^>]*title='ids? ([\d ]+) ·", page)
    assert page.count("<section>") == 8 and sum(len(ids.split()) for ids in spans) == a["actor/action_tokens"]


@pytest.mark.parametrize("example", ["openai_tool_agent.py", "math_env.py", "langchain_agent.py",
                                     "openai_agents_sdk_agent.py"])
def test_examples_train_two_steps(example, tmp_path, tiny_model_dir, prompts):
    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{
        "train.agent_path": str(ROOT / "examples/agents" / example), "train.max_steps": 2,
        "train.force_sync_mode": True, "data.max_len": 1024})  # the tool schema alone is ~250 tokens
    run(cfg)
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["trajectories"] == 8 and m["actor/action_tokens"] > 0 for m in metrics)
    assert not any(k.startswith("agent/dropped") for m in metrics for k in m)


def test_eval_command_scores_every_prompt_without_a_trainer(tmp_path, tiny_model_dir, capsys):
    dataset = tmp_path / "eval.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"Question {i}?", "label": "yes" if i % 10 < 3 else "no"}) + "\n"
                               for i in range(20)))
    main(["eval", "--actor.model_name_or_path", str(tiny_model_dir), "--eval.dataset", str(dataset),
          "--eval.n_samples", "2", "--data.max_new_tokens", "8", "--eval.dump_dir", str(tmp_path / "dump"),
          "--train.agent_path", str(ROOT / "tests/agents/label_env.py"), "--ckpt.output_dir", str(tmp_path / "out"),
          "--log.tensorboard", "true"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "eval accuracy: 0.3 (greedy 0.3)"
    assert {"eval/pass@2: 0.3", "eval/dropped: 0", "eval_greedy/dropped: 0"} <= set(out)
    [logged] = rows(tmp_path / "out/eval.jsonl")  # the same sinks as rl: JSONL and TensorBoard here
    assert logged["model"] == str(tiny_model_dir) and logged["eval/accuracy"] == logged["eval/pass@2"] == 0.3
    assert list((tmp_path / "out/tensorboard/eval").glob("events.out.tfevents.*"))
    dumped = read_jsonl(str(tmp_path / "dump/eval_step_000000.jsonl"))  # 20 x 2 sampled + 20 greedy
    assert len(dumped) == 60 and sum(t.outcome for t in dumped) == 18
    page = write_view(tmp_path / "dump", str(tiny_model_dir), limit=100).read_text()
    assert page.count("<section>") == 60 and page.count("rollout eval_greedy-") == 20
    with pytest.raises(SystemExit, match="--eval.dataset is required"):
        main(["eval", "--actor.model_name_or_path", str(tiny_model_dir)])


def test_the_same_seed_samples_and_trains_alike_on_one_engine_or_two(tmp_path, tiny_model_dir, prompts):
    """Strictly on-policy, the same --actor.seed samples the same tokens however the requests were batched and
    whichever engine served them. The engines' logprobs agree within float rounding only (a row's matmul differs in
    its last bits with the rows in its step); without the importance-sampling correction, which reads them, every
    loss and weight is equal to the bit."""
    outs = []
    for out, engines in (("a", 1), ("b", 1), ("c", 2)):
        run(make_cfg(tmp_path / out, tiny_model_dir, prompts, **{
            "train.force_sync_mode": True, "engine.num_engines": engines, "train.rollout_dump_dir":
            str(tmp_path / out / "dump"), "algo.advantage": AdvantageConfig(is_correction_level="off")}))
        dumps = [t for f in sorted((tmp_path / out / "dump").iterdir()) for t in read_jsonl(str(f))]
        outs.append((rows(tmp_path / out / "run/metrics.jsonl"), [[s.token_ids for s in t.segments] for t in dumps],
                     load_file(tmp_path / out / "run/hf/model.safetensors")))
    (a, tokens, weights), *others = outs
    assert len({str(t) for t in tokens}) > len(tokens) // 2  # the samples of a group differ
    for metrics, their_tokens, their_weights in others:
        assert their_tokens == tokens
        assert all(torch.equal(weights[k], their_weights[k]) for k in weights)
        for key in ("reward", "advantage_abs_mean", "actor/loss", "actor/grad_norm", "actor/entropy"):
            assert [m[key] for m in metrics] == [m[key] for m in a], key
        assert [m["actor/vllm_kl"] for m in metrics] == pytest.approx([m["actor/vllm_kl"] for m in a], abs=1e-6)

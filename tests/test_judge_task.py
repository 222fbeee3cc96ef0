"""The LLM-as-judge recipe (examples/judge): rubric and verdict parsing, the judge's prompt, the frozen judge's
settings, the offline records, the GPU recipe's flags, the Env end to end with the policy as judge and with a
frozen judge on an engine of its own, and two RL steps on the tiny model."""

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
from helpers.agents import JUDGE, SCRIPT, Recorded, hosting, task
from helpers.loop import make_cfg, rows

from instar.agents import ChatServer, load_agent
from instar.checks import check
from instar.cli.main import parse
from instar.config import ConfigError
from instar.contract import read_jsonl
from instar.data.chat import prompt_ids
from instar.engines import EmbeddedEngine
from instar.loop import run

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "examples/judge/task.py"
spec = importlib.util.spec_from_file_location("judge_task", TASK)
judge = importlib.util.module_from_spec(spec)
spec.loader.exec_module(judge)

NAMES = ["accuracy", "completeness", "concision"]
RUBRIC = ["accuracy: agrees with the reference", "completeness: covers its points"]
ENV = ("JUDGE_BASE_URL", "JUDGE_MODEL", "JUDGE_API_KEY")


@pytest.fixture
def no_frozen_judge(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_verdict_parsing_golden():
    replies = {"correct": 1.0, "Correct.": 1.0, "**Wrong**": 0.0, "Incorrect: it says 6.": 0.0,
               "<think>It looks wrong.</think>\ncorrect": 1.0, "The answer is correct.": None, "": None,
               "<think>cut off before a verdict": None}
    assert {r: judge.parse_verdict(r) for r in replies} == replies


def test_rubric_parsing_golden():
    cases = {
        "accuracy: 8\ncompleteness: 6\nconcision: 10": (0.8 + 0.6 + 1.0) / 3,
        "Scores:\n- **Accuracy**: 7/10\n2. completeness = 3 out of 5\n### Concision - 9": (0.7 + 0.6 + 0.9) / 3,
        "accuracy: 2\ncompleteness: 5\nconcision: 5\nOn reflection:\naccuracy: 8": (0.8 + 0.5 + 0.5) / 3,
        "<think>accuracy: 0</think>ACCURACY: 10\ncompleteness:10\nconcision: 7.5": (1.0 + 1.0 + 0.75) / 3,
        "accuracy: 8\ncompleteness: 6": None,  # a criterion missing
        "accuracy: 11\ncompleteness: 6\nconcision: 1": None,  # over the scale
        "accuracy: 6/5\ncompleteness: 6\nconcision: 1": None,
        "accuracy: 1/0\ncompleteness: 6\nconcision: 1": None,
        "The accuracy is 8, completeness 6 and concision 10.": None,  # prose, not the asked lines
        "accuracy: -3\ncompleteness: 6\nconcision: 1": None,
        "<think>accuracy: 8\ncompleteness: 6\nconcision: 10": None,  # thinking cut off by max_tokens
    }
    assert {r: judge.parse_rubric(r, NAMES) for r in cases} == cases


def test_criteria_and_the_judge_prompt():
    assert judge.criteria_of(["Accuracy: agrees", " clear wording :  reads easily "]) == [
        ("accuracy", "agrees"), ("clear wording", "reads easily")]
    assert judge.criteria_of(None) == [] and judge.criteria_of([]) == []
    with pytest.raises(ValueError, match="rubric criterion 'accuracy' must read 'name: what it asks'"):
        judge.criteria_of(["accuracy"])
    # no rubric and no reference: the conversation the scripted model replays (helpers.agents.SCRIPT)
    assert judge.VERDICT == JUDGE
    assert judge.judge_messages("What is 2+3?", "The answer is 5.", None, []) == SCRIPT[2][1][:2]
    system, user = judge.judge_messages("Q?", "A.", "R.", judge.criteria_of(RUBRIC))
    assert system == {"role": "system", "content": (
        "You grade an answer to a question. Rate it on each criterion below from 0 (fails it) to 10 (fully meets "
        "it); when a reference answer is given, it is the standard of correctness.\n\nCriteria:\n"
        "- accuracy: agrees with the reference\n- completeness: covers its points\n\n"
        "Reply with one line per criterion in this form, and nothing else:\naccuracy: <0-10>\ncompleteness: <0-10>")}
    assert user == {"role": "user", "content": "Question: Q?\nReference answer: R.\nAnswer: A."}


def test_frozen_judge_settings(monkeypatch, no_frozen_judge):
    assert judge.frozen_judge() is None
    monkeypatch.setenv("JUDGE_BASE_URL", "http://127.0.0.1:8001/v1")
    with pytest.raises(ConfigError, match=r"JUDGE_BASE_URL='http://127.0.0.1:8001/v1' and JUDGE_MODEL='': set both"):
        judge.frozen_judge()
    monkeypatch.setenv("JUDGE_MODEL", "Qwen/Qwen3-8B")
    assert judge.frozen_judge() == ("http://127.0.0.1:8001/v1", "EMPTY", "Qwen/Qwen3-8B")
    monkeypatch.setenv("JUDGE_API_KEY", "secret")
    assert judge.frozen_judge() == ("http://127.0.0.1:8001/v1", "secret", "Qwen/Qwen3-8B")
    monkeypatch.delenv("JUDGE_BASE_URL")
    with pytest.raises(ConfigError, match="set both"):
        load_agent(str(TASK))  # a bad setting fails when the file loads (instar rl's start-up checks)


def test_a_reference_column_without_the_label_flag_is_an_error():
    state = {"label": None, "metadata": {"reference": "5"}}
    with pytest.raises(ConfigError, match="'reference' column but no label: pass --data.label_key reference"):
        asyncio.run(judge.JudgedEnv().step(state))


def test_records_hold_out_the_eval_topics(tmp_path):
    out = judge.write_datasets(tmp_path)
    train, evals = ([json.loads(line) for line in (out / f"{n}.jsonl").read_text().splitlines()]
                    for n in ("train", "eval"))
    assert (len(train), len(evals)) == (36, 12)
    assert all(set(r) == {"prompt", "reference", "rubric"} for r in train + evals)
    assert all([n for n, _ in judge.criteria_of(r["rubric"])][:2] == ["accuracy", "completeness"]
               for r in train + evals)
    assert not {r["reference"] for r in train} & {r["reference"] for r in evals}
    assert judge.write_datasets(tmp_path / "again").joinpath("eval.jsonl").read_text() == (
        out / "eval.jsonl").read_text()


def test_the_gpu_recipe_parses():
    _, cfg = parse(["rl", "--config", str(ROOT / "examples/judge/rl.yaml")])
    assert (cfg.train.agent_path, cfg.data.label_key, cfg.actor.model_name_or_path) == (
        "examples/judge/task.py", "reference", "Qwen/Qwen3-1.7B")
    assert (cfg.engine.num_engines, cfg.fsdp.num_ranks) == (3, 4)  # GPU 7 left to a frozen judge
    check(cfg)


@pytest.mark.asyncio
async def test_the_policy_judges_itself_through_the_untraced_route(scripted, no_frozen_judge):
    tok = scripted.tokenizer
    async with hosting(scripted, load_agent(str(TASK))) as (host, engine):
        verdict = await host.rollout(task(label=None))  # no rubric, no reference: the script's judge turn
        rubric = await host.rollout(task(label="5", metadata={"rubric": RUBRIC}))
    assert (verdict.reward, verdict.info) == (1.0, {"turns": [{"unparseable": 0, "verdict": "correct"}]})
    assert [sid.endswith("/untraced") for _, _, sid in engine.calls] == [False, True, False, True]
    # with a rubric the tiny model's reply is what it is: the reward is what the parser makes of it
    messages = judge.judge_messages("What is 2+3?", "The answer is 5.", "5", judge.criteria_of(RUBRIC))
    assert engine.calls[3][0] == prompt_ids(tok, messages)
    [info] = rubric.info["turns"]
    score = judge.parse_rubric(info["verdict"], ["accuracy", "completeness"])
    assert (rubric.reward, rubric.score, info["unparseable"]) == (score or 0.0, score or 0.0, int(score is None))


@pytest.mark.asyncio
async def test_a_frozen_judge_on_its_own_engine_does_all_the_judging(scripted, monkeypatch, no_frozen_judge):
    tok = scripted.tokenizer
    judge_engine = Recorded(EmbeddedEngine.from_pretrained(scripted.path))  # not the policy's engine
    try:
        async with ChatServer(judge_engine, tok, model_name="frozen-judge", max_len=1024,
                              max_new_tokens=64) as server:
            session = server.open()
            monkeypatch.setenv("JUDGE_BASE_URL", session.untraced_base_url)
            monkeypatch.setenv("JUDGE_API_KEY", session.api_key)
            monkeypatch.setenv("JUDGE_MODEL", server.model_name)
            async with hosting(scripted, load_agent(str(TASK))) as (host, engine):
                traj = await host.rollout(task(label=None))
            server.close(session)
    finally:
        await judge_engine.engine.close()
    assert (traj.reward, traj.info) == (1.0, {"turns": [{"unparseable": 0, "verdict": "correct"}]})
    [(_, _, sid)] = engine.calls  # the policy's engine only answered
    assert not sid.endswith("/untraced")
    [(ids, gen, sid)] = judge_engine.calls
    assert sid == session.untraced_id
    assert ids == prompt_ids(tok, judge.judge_messages("What is 2+3?", "The answer is 5.", None, []))
    assert tok.decode(gen.token_ids, skip_special_tokens=True) == "correct"


@pytest.mark.slow
def test_two_rl_steps_on_the_tiny_model_with_the_policy_as_judge(tmp_path, tiny_model_dir, no_frozen_judge):
    data = judge.write_datasets(tmp_path / "data")
    cfg = make_cfg(tmp_path, tiny_model_dir, str(data / "train.jsonl"), **{
        "train.agent_path": str(TASK), "train.max_steps": 2, "train.force_sync_mode": True,
        "data.label_key": "reference", "data.max_new_tokens": 16, "data.max_len": 1024,
        "train.rollout_dump_dir": str(tmp_path / "dump")})
    run(cfg)
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["trajectories"] == 8 for m in metrics)
    assert all(0 <= m["info/unparseable/mean"] <= 1 for m in metrics)
    trajectories = [t for f in sorted((tmp_path / "dump").iterdir()) for t in read_jsonl(str(f))]
    assert len(trajectories) == 16
    for t in trajectories:  # the prompt and one trained answer: the judge's call left nothing in the trajectory
        [seg] = t.segments
        prompt = seg.action_mask.index(1)
        assert seg.action_mask == [0] * prompt + [1] * (len(seg.action_mask) - prompt)
        assert 0 <= t.reward <= 1 and t.score == t.reward and set(t.metadata) == {"rubric"}

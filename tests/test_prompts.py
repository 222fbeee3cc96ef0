"""Prompt loading and the data ledger: after a resume nothing is lost and nothing trained twice."""

import json

import pytest

from instar.config import DataConfig
from instar.data.prompts import Prompt, PromptStream, load_prompts


def write(tmp_path, records):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_load_normalises_prompts(tmp_path):
    path = write(tmp_path, [{"prompt": "1+1?", "label": "2", "level": 3},
                            {"prompt": [{"role": "user", "content": "hi"}], "label": None, "tools": [{"name": "t"}]}])
    a, b = load_prompts(path, DataConfig(system_prompt="Be brief."))
    assert a.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    assert (a.index, a.label, a.tools, a.metadata) == (0, "2", None, {"level": 3})
    assert (b.index, b.tools, b.messages[-1]) == (1, [{"name": "t"}], {"role": "user", "content": "hi"})


def test_load_errors_are_actionable(tmp_path):
    with pytest.raises(ValueError, match="--data.prompt_dataset '.*missing.jsonl' does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"), DataConfig())
    with pytest.raises(ValueError, match=r"p.jsonl' has no 'prompt' column or nested field "
                                         r"\(columns: \['question'\]\); set --data.input_key"):
        load_prompts(write(tmp_path, [{"question": "x"}]), DataConfig())
    with pytest.raises(ValueError, match="must be a string or a list of chat messages, got int"):
        load_prompts(write(tmp_path, [{"prompt": 7}]), DataConfig())


def test_stream_epochs_are_seeded_permutations(tmp_path):
    prompts = load_prompts(write(tmp_path, [{"prompt": str(i)} for i in range(5)]), DataConfig())
    s = PromptStream(prompts, seed=1)
    first = [s.next() for _ in range(10)]
    assert sorted(p.index for e, p in first if e == 0) == [0, 1, 2, 3, 4]
    assert sorted(p.index for e, p in first if e == 1) == [0, 1, 2, 3, 4]
    again = PromptStream(prompts, seed=1)
    assert [(e, p.index) for e, p in first] == [(e, p.index) for e, p in (again.next() for _ in range(10))]
    assert [p.index for _, p in first[:5]] != list(range(5)) or [p.index for _, p in first[5:]] != list(range(5))


def test_resume_hands_out_exactly_the_untrained(tmp_path):
    prompts = load_prompts(write(tmp_path, [{"prompt": str(i)} for i in range(6)]), DataConfig())
    s = PromptStream(prompts, seed=0)
    handed = [s.next() for _ in range(8)]  # all of epoch 0 and two of epoch 1
    trained, pending = handed[:3], handed[3:5]  # the rest were in flight when the run died
    for e, p in trained:
        s.mark_trained(e, p.index)
    state = s.state_dict()
    assert state["epoch"] == 0

    resumed = PromptStream(prompts, seed=0)
    resumed.load_state_dict(state, pending=[(e, p.index) for e, p in pending])
    redo = [resumed.next() for _ in range(len(handed) - 5)]
    assert sorted((e, p.index) for e, p in redo) == sorted((e, p.index) for e, p in handed[5:])
    for e, p in trained:
        with pytest.raises(RuntimeError, match="already trained"):
            resumed.mark_trained(e, p.index)


def test_rejected_prompts_are_not_served_again_after_a_resume(tmp_path):
    prompts = load_prompts(write(tmp_path, [{"prompt": str(i)} for i in range(4)]), DataConfig())
    s = PromptStream(prompts, seed=0)
    epoch0 = [s.next() for _ in range(4)]
    s.mark_rejected(*[(e, p.index) for e, p in epoch0[:1]][0])  # the dynamic filter rejected its group
    for e, p in epoch0[1:]:
        s.mark_trained(e, p.index)
    resumed = PromptStream(prompts, seed=0)
    resumed.load_state_dict(s.state_dict())
    served = [(e, p.index) for e, p in (resumed.next() for _ in range(4))]
    assert sorted(served) == [(1, 0), (1, 1), (1, 2), (1, 3)]  # none of epoch 0; the next epoch serves it again


def test_a_second_resume_does_not_serve_a_finished_epoch_again():
    """The state saved after a resume starts no earlier than the resumed epoch: the finished epochs'
    records were dropped at the first save, so the stream must not count them as untrained."""
    prompts = [Prompt(i, [{"role": "user", "content": str(i)}]) for i in range(4)]
    a = PromptStream(prompts, seed=0)
    for _ in range(6):  # all of epoch 0 and two of epoch 1
        e, p = a.next()
        a.mark_trained(e, p.index)
    b = PromptStream(prompts, seed=0)
    b.load_state_dict(a.state_dict())
    e, p = b.next()
    b.mark_trained(e, p.index)
    c = PromptStream(prompts, seed=0)
    c.load_state_dict(b.state_dict())
    e, p = c.next()
    assert e == 1 and (e, p.index) not in b.trained  # the last untrained prompt of epoch 1


def test_overlong_prompts_are_dropped_at_load_and_the_ledger_keeps_record_indices(tmp_path, tiny_model_dir, capsys):
    from instar.config import ConfigError
    from instar.data.chat import load_tokenizer, prompt_ids
    from instar.data.prompts import drop_overlong

    tokenizer = load_tokenizer(str(tiny_model_dir))
    records = [{"prompt": "short"}, {"prompt": "long " * 40}, {"prompt": "brief"}, {"prompt": "long " * 80}]
    prompts = load_prompts(write(tmp_path, records), DataConfig())
    limit = len(prompt_ids(tokenizer, prompts[1].messages)) + 1  # record 1 leaves one token: kept
    kept = drop_overlong(prompts, tokenizer, limit)
    assert [p.index for p in kept] == [0, 1, 2]
    assert capsys.readouterr().out == f"instar: dropped 1 of 4 prompts: they fill --data.max_len {limit}\n"
    assert [p.index for p in drop_overlong(prompts, tokenizer, limit - 1)] == [0, 2]
    with pytest.raises(ConfigError, match="every prompt fills --data.max_len 3; raise it"):
        drop_overlong(prompts, tokenizer, 3)
    s = PromptStream(drop_overlong(prompts, tokenizer, limit - 1), seed=0)
    served = [s.next() for _ in range(2)]
    for e, p in served:  # keys are record indices, not list positions
        s.mark_trained(e, p.index)
    assert sorted(p.index for _, p in served) == [0, 2] and s.state_dict()["trained"] == [(0, 0), (0, 2)]

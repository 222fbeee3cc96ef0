"""The VLM demo's shape-counting task (examples/vlm/task.py): the generator is deterministic by seed, its
labels are the number of shapes actually drawn (counted here from the pixels), the grader is exact."""

import asyncio
import collections
import hashlib
import importlib.util
import json
import random
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def task():
    spec = importlib.util.spec_from_file_location("vlm_task", ROOT / "examples" / "vlm" / "task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blobs(image: Image.Image) -> int:
    """Connected regions of non-white pixels (4-neighbourhood), counted from the pixels alone."""
    w, h = image.size
    px = image.convert("RGB").load()
    ink = {(x, y) for y in range(h) for x in range(w) if px[x, y] != (255, 255, 255)}
    count = 0
    while ink:
        count += 1
        stack = [ink.pop()]
        while stack:
            x, y = stack.pop()
            for n in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if n in ink:
                    ink.remove(n)
                    stack.append(n)
    return count


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_labels_are_the_shapes_in_the_pixels(task):
    items = task.problems(12, seed=5)
    assert [p["label"] for p in items] == [str(len(p["shapes"])) for p in items]
    for p in items:
        assert p["image"].size == (128, 128)
        assert blobs(p["image"]) == int(p["label"])
        colors = {c for _, c in p["image"].getcolors()} - {(255, 255, 255)}
        assert colors == {task.COLORS[s["color"]] for s in p["shapes"]}
        for s in p["shapes"]:  # every shape inside its own quadrant
            x0, y0, x1, y1 = s["box"]
            cx, cy = (s["cell"] % 2) * 64, (s["cell"] // 2) * 64
            assert cx < x0 <= x1 < cx + 64 and cy < y0 <= y1 < cy + 64


def test_counts_cover_one_to_four(task):
    counts = collections.Counter(p["label"] for p in task.problems(200, seed=0))
    assert set(counts) == {"1", "2", "3", "4"} and min(counts.values()) > 30


def test_generation_is_deterministic_by_seed(task, tmp_path):
    a, b, c = (task.write_datasets(tmp_path / name, seed=s, n_train=6, n_eval=4, n_sft=6)
               for name, s in (("a", 7), ("b", 7), ("c", 8)))
    for name in ("train.jsonl", "eval.jsonl", "sft.jsonl"):
        assert (a / name).read_text() == (b / name).read_text()
    pngs = sorted(p.name for p in (a / "images").iterdir())
    assert len(pngs) == 16 and pngs == sorted(p.name for p in (b / "images").iterdir())
    assert all(digest(a / "images" / n) == digest(b / "images" / n) for n in pngs)
    assert any(digest(a / "images" / n) != digest(c / "images" / n) for n in pngs)
    # the splits hold different pictures
    hashes = {n.split("-")[0]: {digest(a / "images" / m) for m in pngs if m.startswith(n.split("-")[0])}
              for n in pngs}
    assert not (hashes["train"] & hashes["eval"]) and not (hashes["eval"] & hashes["sft"])


def test_written_records(task, tmp_path):
    out = task.write_datasets(tmp_path, seed=3, n_train=5, n_eval=5, n_sft=40)
    train = [json.loads(line) for line in (out / "train.jsonl").open()]
    sft = [json.loads(line) for line in (out / "sft.jsonl").open()]
    assert len(train) == 5 and len(sft) == 40 and len((out / "eval.jsonl").read_text().splitlines()) == 5
    for record in train:
        (message,) = record["prompt"]
        image, text = message["content"]
        assert message["role"] == "user" and image["type"] == "image"
        assert text == {"type": "text", "text": task.QUESTION}
        assert blobs(Image.open(out / image["image"])) == int(record["label"])  # the path is relative to out
    wrong = 0
    for record in sft:
        user, answer = record["messages"]
        truth = blobs(Image.open(out / user["content"][0]["image"]))
        assert answer["role"] == "assistant" and answer["content"] in (str(truth), str(truth - 1))
        assert truth > 1 or answer["content"] == "1"
        wrong += answer["content"] != str(truth)
    assert 0 < wrong < len(sft)  # imperfect, not useless


def test_demonstrations_undercount_at_the_stated_rate(task):
    rng = random.Random(0)
    answers = collections.Counter(task.demo_answer("3", rng) for _ in range(4000))
    assert set(answers) == {"2", "3"} and abs(answers["2"] / 4000 - task.UNDERCOUNT) < 0.03
    assert {task.demo_answer("1", rng) for _ in range(100)} == {"1"}


@pytest.mark.parametrize("answer, label, reward", [
    ("3", "3", 1.0), (" 3\n", "3", 1.0), ("3<|im_end|>", "3", 1.0), ("4", "3", 0.0), ("33", "3", 0.0),
    ("3.", "3", 0.0), ("three", "3", 0.0), ("", "3", 0.0), ("The answer is 3", "3", 0.0), ("1", "1", 1.0)])
def test_grade_is_exact(task, answer, label, reward):
    assert task.grade(answer, label) == reward


def test_env_rewards_the_exact_count(task):
    from instar.agents import StepEnvRunner
    assert isinstance(task.AgentRunner, StepEnvRunner) and task.AgentRunner.env_class is task.CountEnv

    async def step(text):
        return await task.CountEnv().step({"action_text": text, "label": "2", "turn": 0, "messages": []})

    right, wrong = asyncio.run(step("2")), asyncio.run(step("3"))
    assert (right.reward, right.score, right.terminated) == (1.0, 1.0, True)
    assert (wrong.reward, wrong.score) == (0.0, 0.0)

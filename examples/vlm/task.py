"""The shape-counting task: a 128x128 picture holds 1-4 large shapes (squares, circles, triangles of a few
bright colors, one per quadrant) and the model answers how many, as one digit. A tiny vision-language
model with a random-init vision tower can learn it; the warm-start demonstrations undercount, so SFT
alone stops well short of the ceiling and RL on the exact reward has room.

Train with `--train.agent_path examples/vlm/task.py`; write the datasets (PNGs under images/ and the
JSONL files that name them by relative path) with `python examples/vlm/task.py OUT_DIR [SEED]`.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw

from instar.agents import Env, Result, StepEnvRunner

SIZE = 128  # pixels a side: 8x8 patches of 16, 16 image tokens after the 2x2 merge
CELL = SIZE // 2  # one shape per quadrant at most, so shapes never touch or overlap
MARGIN = 4  # the least gap between a shape and its quadrant's edge
KINDS = ("square", "circle", "triangle")
COLORS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 60, 220), "orange": (245, 140, 20),
          "purple": (140, 40, 180)}
BACKGROUND = (255, 255, 255)
QUESTION = "How many shapes are in the picture? Answer with a digit."
END_TOKEN = "<|im_end|>"
UNDERCOUNT = 0.7  # how often a demonstration of 2-4 shapes says one fewer


def make_picture(rng: random.Random) -> tuple[Image.Image, list[dict]]:
    """A white canvas with 1-4 shapes, each alone in its own quadrant; returns it and the shapes drawn."""
    n = rng.randint(1, 4)
    cells = rng.sample(range(4), n)
    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    shapes = []
    for cell in sorted(cells):
        side = rng.randint(36, CELL - 2 * MARGIN)
        x0 = (cell % 2) * CELL + rng.randint(MARGIN, CELL - MARGIN - side)
        y0 = (cell // 2) * CELL + rng.randint(MARGIN, CELL - MARGIN - side)
        box = (x0, y0, x0 + side - 1, y0 + side - 1)
        kind, color = rng.choice(KINDS), rng.choice(sorted(COLORS))
        fill = COLORS[color]
        if kind == "square":
            draw.rectangle(box, fill=fill)
        elif kind == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(x0 + side // 2, y0), (box[2], box[3]), (x0, box[3])], fill=fill)
        shapes.append({"kind": kind, "color": color, "box": list(box), "cell": cell})
    return image, shapes


def problems(n: int, seed: int) -> list[dict]:
    """``n`` pictures (PIL images, not yet written) with their labels, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        image, shapes = make_picture(rng)
        out.append({"image": image, "shapes": shapes, "label": str(len(shapes))})
    return out


def grade(answer: str, label: str) -> float:
    """1.0 for exactly the right digit (surrounding whitespace and a trailing end token ignored), else 0.0."""
    answer = answer.strip()
    if answer.endswith(END_TOKEN):
        answer = answer[: -len(END_TOKEN)].strip()
    return float(answer == str(label).strip())


def demo_answer(label: str, rng: random.Random) -> str:
    """An imperfect demonstration: the demonstrator misses a shape in 60% of the pictures with 2 or more,
    so the most common demonstrated answer is wrong for 2, 3 and 4 shapes, yet the right one is common
    enough (40%) for the warm-started policy to sample it and for RL's reward to pick it out."""
    n = int(label)
    return str(n - 1) if n >= 2 and rng.random() < UNDERCOUNT else label


def user_message(image_path: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": image_path}, {"type": "text", "text": QUESTION}]}


def write_datasets(out: str | Path, seed: int = 0, n_train: int = 2000, n_eval: int = 200,
                   n_sft: int = 2000) -> Path:
    """PNGs under ``out``/images/ and train.jsonl, eval.jsonl (prompts and labels) and sft.jsonl
    (imperfect demonstrations), each split from its own seed so no picture repeats across splits by design."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    splits = {"train": (n_train, 1), "eval": (n_eval, 2), "sft": (n_sft, 3)}
    for name, (n, offset) in splits.items():
        demo_rng = random.Random(f"{seed}-{name}-demo")
        with (out / f"{name}.jsonl").open("w") as f:
            for i, p in enumerate(problems(n, seed=seed * 10 + offset)):
                path = f"images/{name}-{i:05d}.png"
                p["image"].save(out / path, format="PNG")
                message = user_message(path)
                if name == "sft":
                    record = {"messages": [message, {"role": "assistant",
                                                     "content": demo_answer(p["label"], demo_rng)}]}
                else:
                    record = {"prompt": [message], "label": p["label"]}
                f.write(json.dumps(record) + "\n")
    return out


class CountEnv(Env):
    """One turn: the model's answer, reward 1 for the exact count."""

    async def step(self, state: dict) -> Result:
        reward = grade(state["action_text"], state["label"])
        return Result(reward=reward, score=reward)


AgentRunner = StepEnvRunner(CountEnv)


if __name__ == "__main__":
    print(write_datasets(sys.argv[1], seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0))

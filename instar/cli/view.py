"""`instar view`: dumped trajectories (``--train.rollout_dump_dir``, ``--eval.dump_dir``) as one
token-level HTML page.

Every token is shown as the model saw it. Context tokens (prompt, chat template, tool results) are
grey; sampled tokens are shaded by the probability the engine gave them, from green (likely) to red
(unlikely), so a surprising token stands out. Hovering a token shows its id, logprob and the policy
version that sampled it. Segments are split where the agent rewrote its history. An image (a
vision-language model's dump) is shown where its placeholder tokens are, rebuilt from the patches the
model was given, so what is on the page is what the model saw.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable
from pathlib import Path

from instar.cli.report import html_page
from instar.contract import ImageInputs, Sample, Trajectory, read_jsonl
from instar.data.chat import load_tokenizer
from instar.data.images import Vision, data_url

STYLE = """body{font-family:sans-serif;margin:1.5em}section{border:1px solid #ccc;border-radius:6px;padding:.6em;
margin:1em 0}h2{font-size:1em;margin:.2em 0}.t{font-family:monospace;white-space:pre-wrap;line-height:1.6}
.c{color:#777}.a{border-radius:2px}.seg{border-top:2px dashed #999;margin:.5em 0;color:#999;font-size:.8em}
img{vertical-align:middle;border:1px solid #999;margin:2px;image-rendering:pixelated}
.meta{color:#555;font-size:.8em;font-family:monospace}"""


def load_dump(path: str | Path) -> list[tuple[str, Trajectory]]:
    """(file name, trajectory) from one dump file or every one in a directory: training rollouts
    (``step_N.jsonl``) and eval rollouts (``eval_step_N.jsonl``), each kind in step order."""
    path = Path(path)
    files = sorted(path.glob("*step_*.jsonl")) if path.is_dir() else [path]
    if not files or not files[0].is_file():
        raise FileNotFoundError(f"no rollout dump at {path}: pass a step_N.jsonl file or a directory of them "
                                "(--train.rollout_dump_dir, --eval.dump_dir)")
    return [(f.name, t) for f in files for t in read_jsonl(str(f))]


def _token(text: str, token_ids: list[int], action: bool, logprob: float, version: int) -> str:
    shown = html.escape(text.replace("\n", "\u21b5\n"))
    ids = f"id {token_ids[0]}" if len(token_ids) == 1 else f"ids {' '.join(map(str, token_ids))}"
    if not action:
        return f"<span class=c title='{ids}'>{shown}</span>"
    p = math.exp(logprob)
    colour = f"hsl({120 * p:.0f},70%,80%)"  # 0 -> red, 1 -> green
    tip = f"{ids} · logprob {logprob:.4f} · p {p:.3f} · version {version}"
    return f"<span class=a style='background:{colour}' title='{tip}'>{shown}</span>"


def token_pieces(token_ids: list[int], decode: Callable[[list[int]], str]) -> list[tuple[int, int, str]]:
    """``(start, end, text)`` spans covering ``token_ids`` in order, one per token, except that tokens
    carrying bytes of one character (byte-level BPE splits multi-byte UTF-8) share a span that shows it whole.
    Each text is read as the difference a token makes after a few tokens of context, as a decoder may treat
    a lone token differently (a leading space, an incomplete character decoded as U+FFFD)."""
    pieces: list[tuple[int, int, str]] = []
    start = 0
    for end in range(1, len(token_ids) + 1):
        context = max(0, start - 4)
        text = decode(token_ids[context:end])
        if text.endswith("\ufffd") and end < len(token_ids) and end - start < 4:  # UTF-8: at most 4 bytes
            continue
        pieces.append((start, end, text[len(decode(token_ids[context:start])):]))
        start = end
    return pieces


Pictures = Callable[[ImageInputs], list]  # a dump's images back as PIL pictures (`Vision.pictures`)


def _segment(sample: Sample, decode: Callable[[list[int]], str], pictures: Pictures | None = None) -> str:
    spans = []
    runs = sample.images.runs(sample.token_ids) if sample.images is not None and pictures else []
    shown = {a: (z, picture) for (a, z), picture in zip(runs, pictures(sample.images))} if runs else {}
    inside = {t for a, z in runs for t in range(a, z)}
    for start, end, text in token_pieces(sample.token_ids, decode):
        if start in shown:  # an image's placeholder run: the picture once, in place of its tokens
            z, picture = shown[start]
            spans.append(f"<img src='{data_url(picture)}' title='image: {z - start} tokens of id "
                         f"{sample.token_ids[start]}, {picture.width}x{picture.height} as the model saw it'>")
        if start in inside:
            continue
        mask = sample.action_mask[start:end]
        logprob = sum(lp for lp, m in zip(sample.rollout_logprobs[start:end], mask) if m)  # of the whole span
        spans.append(_token(text, sample.token_ids[start:end], any(mask), logprob, sample.versions[end - 1]))
    return "".join(spans)


def render(items: list[tuple[str, Trajectory]], decode: Callable[[list[int]], str], title: str,
           pictures: Pictures | None = None) -> str:
    """The HTML page for ``items``; ``decode`` turns token ids into text, ``pictures`` images into pictures."""
    sections = []
    for source, t in items:
        versions = sorted({v for s in t.segments for v, m in zip(s.versions, s.action_mask) if m})
        head = (f"{html.escape(source)} · rollout {html.escape(t.rollout_id)} · prompt {t.prompt_index} · "
                f"reward {t.reward:g}" + (f" · score {t.score:g}" if t.score is not None else "") +
                f" · {html.escape(t.finish_reason)} · {sum(s.num_actions for s in t.segments)} sampled tokens"
                f" · versions {versions}")
        body = "<div class=seg>history rewritten: new segment</div>".join(
            f"<div class=t>{_segment(s, decode, pictures)}</div>" for s in t.segments)
        meta = f"<p class=meta>{html.escape(json.dumps(t.metadata, default=str)[:2000])}</p>" if t.metadata else ""
        sections.append(f"<section><h2>{head}</h2>{meta}{body}</section>")
    legend = ("<p>grey: context (prompt, template, tool results); shaded: sampled, green = likely, "
              "red = unlikely; hover a token for its id, logprob and policy version.</p>")
    return html_page(title, STYLE, legend + "".join(sections))


def write_view(path: str | Path, tokenizer_path: str, out: str | Path | None = None, limit: int = 64) -> Path:
    """Render the first ``limit`` trajectories of a dump to ``out`` (default: ``view.html`` beside it)."""
    items = load_dump(path)[:limit]
    tokenizer = load_tokenizer(tokenizer_path)
    path = Path(path)
    target = Path(out) if out else (path if path.is_dir() else path.parent) / "view.html"
    vision = Vision.from_pretrained(tokenizer_path)
    page = render(items, tokenizer.decode, f"instar view: {path.name}", vision.pictures if vision else None)
    target.write_text(page, encoding="utf-8")
    return target

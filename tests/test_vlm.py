"""Images reach the model: the tiny Qwen3-VL through the image processor, the embedded engine, the
trainer's forward and the chat server; the multimodal rotary positions equal transformers' own."""

import asyncio

import pytest
import torch
from PIL import Image, ImageDraw

from instar.contract import ContractError, ImageInputs, SamplingParams
from instar.data.chat import prompt_ids
from instar.data.images import Vision, data_url, image_urls, normalise


def picture(color: str, shape: str = "square") -> Image.Image:
    image = Image.new("RGB", (128, 128), "white")
    draw = ImageDraw.Draw(image)
    (draw.rectangle if shape == "square" else draw.ellipse)((24, 24, 100, 100), fill=color)
    return image


def image_prompt(path, tokenizer, vision, *images, text="What is it?"):
    """Expanded prompt ids and the images' inputs for one user turn holding ``images``."""
    content = [*({"type": "image", "image": im} for im in images), {"type": "text", "text": text}]
    messages = normalise([{"role": "user", "content": content}])
    ids, inputs = vision.expand(prompt_ids(tokenizer, messages), image_urls(messages))
    return ids, ImageInputs.cat(inputs)


def hf_logprobs(model, ids, images, sampled):
    """Logprobs of ``sampled`` after ``ids`` from transformers' own forward of the whole sequence."""
    full = torch.tensor([ids + sampled])
    kind = (full == images.token_id).int() if images is not None else None
    extra = {} if images is None else dict(pixel_values=images.pixel_values, image_grid_thw=images.grid_thw,
                                           mm_token_type_ids=kind)
    with torch.no_grad():
        logits = model(input_ids=full, **extra).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(sampled)]


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_vlm_dir), Vision.from_pretrained(tiny_vlm_dir)


def test_rotary_positions_equal_transformers_rope_index(vlm):
    model, _, vision = vlm
    grid = torch.tensor([[1, 4, 6], [1, 8, 8], [1, 2, 2]])
    p = vision.token_id
    ids = [5, 6] + [p] * 6 + [7, 8, 9] + [p] * 16 + [10] + [p] + [3, 3]
    images = ImageInputs(torch.zeros(int(grid.prod(1).sum()), 1536), grid, p)
    theirs, _ = model.model.get_rope_index(torch.tensor([ids]), (torch.tensor([ids]) == p).int(), grid)
    assert torch.equal(images.positions(ids), theirs[:, 0])
    assert images.positions(ids)[:, :4].tolist() == [[0, 1, 2, 2], [0, 1, 2, 2], [0, 1, 2, 3]]


def test_the_processor_expands_one_placeholder_per_merged_patch(vlm):
    _, tokenizer, vision = vlm
    ids, images = image_prompt(None, tokenizer, vision, picture("red"), picture("blue", "circle"))
    assert images.grid_thw.tolist() == [[1, 8, 8], [1, 8, 8]] and images.counts == [16, 16]
    assert ids.count(vision.token_id) == 32
    images.validate(ids, "prompt")
    with pytest.raises(ContractError, match=r"runs in token_ids have \[16\] tokens, the image features \[16, 16\]"):
        images.validate([t for i, t in enumerate(ids) if i < ids.index(vision.token_id) + 16 or t != vision.token_id],
                        "prompt")


def test_embedded_engine_sees_the_image_and_agrees_with_transformers(vlm):
    from instar.engines.embedded import EmbeddedEngine
    model, tokenizer, vision = vlm
    engine = EmbeddedEngine(model)
    red, _ = image_prompt(None, tokenizer, vision, picture("red"))
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3)

    async def run():
        ids, images = image_prompt(None, tokenizer, vision, picture("red"))
        _, blue = image_prompt(None, tokenizer, vision, picture("blue", "circle"))
        # a group of 3 with one prompt (computed once, copied), and the same ids with another image
        outs = await asyncio.gather(*(engine.generate(ids, params.replace(seed=s), images=images) for s in range(3)),
                                    engine.generate(ids, params.replace(seed=0), images=blue))
        await engine.close()
        return ids, images, blue, outs

    ids, images, blue, outs = asyncio.run(run())
    for out in outs[:3]:
        ref = hf_logprobs(model, ids, images, out.token_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref)) < 1e-4
    ref = hf_logprobs(model, ids, blue, outs[3].token_ids)
    assert max(abs(a - b) for a, b in zip(outs[3].logprobs, ref)) < 1e-4
    # the same sampled ids score differently under the other image: the image reaches the decoder
    other = hf_logprobs(model, ids, blue, outs[0].token_ids)
    assert max(abs(a - b) for a, b in zip(outs[0].logprobs, other)) > 1e-3
    assert red == ids


def test_data_urls_from_every_source(tmp_path):
    image = picture("green")
    image.save(tmp_path / "g.png")
    url = data_url(image)
    assert url.startswith("data:image/png;base64,")
    assert data_url("g.png", tmp_path) == url == data_url((tmp_path / "g.png").read_bytes())
    assert data_url(url.split(",", 1)[1]) == url and data_url(url) == url
    from instar.config import ConfigError
    with pytest.raises(ConfigError, match="record 7: 'missing.png' is neither a file"):
        data_url("missing.png", tmp_path, "record 7")
    with pytest.raises(ConfigError, match="record 8: not a readable image"):
        data_url(b"not an image", where="record 8")


def test_trainer_logprobs_see_the_image_and_equal_the_engines(vlm, tiny_vlm_dir):
    """Packed rows (two different images, a shared prompt) through the trainer's forward: each sample's
    logprobs equal transformers' forward of it alone and differ when the image is blanked."""
    from instar.contract import Sample
    from instar.train.batch import collate
    from instar.train.model import forward_logits, load_model, next_token_logprobs
    model, tokenizer, vision = vlm
    trainer = load_model(str(tiny_vlm_dir)).eval()
    samples, refs = [], []
    for color, sampled in (("red", [40, 41, 42]), ("red", [40, 43]), ("blue", [40, 41, 42]), (None, [44, 45])):
        ids, images = (image_prompt(None, tokenizer, vision, picture(color)) if color
                       else (prompt_ids(tokenizer, [{"role": "user", "content": "no image"}]), None))
        n = len(ids) + len(sampled)
        context, actions = [0] * len(ids), [1] * len(sampled)
        samples.append(Sample(ids + sampled, context + actions, [0.0] * len(ids) + [-1.0] * len(sampled),
                              [-1] * len(ids) + [0] * len(sampled), images=images))
        samples[-1].validate()
        refs.append(hf_logprobs(model, ids, images, sampled))
        assert n == len(samples[-1].token_ids)
    for share in (False, True):
        mb = collate(samples, list(range(len(samples))), share=share)
        assert mb.images.grid_thw.shape[0] == (2 if share else 3)  # the shared red prompt's image once
        with torch.no_grad():
            logits = forward_logits(trainer, mb.input_ids, mb.position_ids, None, mb.attention_kwargs, mb.images,
                                    mb.rope)
        if share:  # a shared row: one position predicts a different token for each continuation
            logp = torch.log_softmax(logits[0].float(), -1)
            got = [[float(logp[mb.gather[b, t], samples[b].token_ids[t]]) for t in range(len(samples[b].token_ids))
                    if samples[b].action_mask[t]] for b in range(len(samples))]
        else:
            row, _ = next_token_logprobs(logits, mb.input_ids)
            unpacked = mb.unpack(row)
            got = [[float(unpacked[b, t]) for t in range(len(s.token_ids)) if s.action_mask[t]]
                   for b, s in enumerate(samples)]
        for mine, ref in zip(got, refs):
            assert max(abs(a - b) for a, b in zip(mine, ref)) < 1e-4
    blank = Sample(**{**samples[0].__dict__, "images": ImageInputs(torch.zeros_like(samples[0].images.pixel_values),
                                                                   samples[0].images.grid_thw, vision.token_id)})
    mb = collate([blank], [0])
    with torch.no_grad():
        row, _ = next_token_logprobs(forward_logits(trainer, mb.input_ids, mb.position_ids, None, None, mb.images,
                                                    mb.rope), mb.input_ids)
    blanked = [float(mb.unpack(row)[0, t]) for t in range(len(blank.token_ids)) if blank.action_mask[t]]
    assert max(abs(a - b) for a, b in zip(blanked, refs[0])) > 1e-3


@pytest.mark.slow
def test_rl_loop_trains_a_vlm_on_image_prompts(tmp_path, tiny_vlm_dir):
    """instar rl on image prompts (a content part with a relative path, and an images column with an
    <image> marker): two FSDP ranks, engine and trainer agree on-policy, the dumps carry the images."""
    import json
    from pathlib import Path

    from helpers.loop import make_cfg, rows

    from instar.contract import read_jsonl
    from instar.loop import run

    (tmp_path / "img").mkdir()
    records = []
    for i, (color, shape) in enumerate([("red", "square"), ("blue", "circle"), ("green", "square"), ("red", "circle")]):
        picture(color, shape).save(tmp_path / f"img/{i}.png")
        if i % 2:
            records.append({"prompt": "Look: <image> What is it?", "images": [f"img/{i}.png"], "label": color})
        else:
            records.append({"prompt": [{"role": "user", "content": [{"type": "image", "image": f"img/{i}.png"},
                                                                    {"type": "text", "text": "What is it?"}]}],
                            "label": color})
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = make_cfg(tmp_path, tiny_vlm_dir, str(data), **{"train.force_sync_mode": True, "fsdp.num_ranks": 2,
                                                         "train.max_steps": 2, "data.max_new_tokens": 8,
                                                         "train.rollout_dump_dir": str(tmp_path / "dump")})
    run(cfg)
    metrics = rows(tmp_path / "run/metrics.jsonl")
    # The random-init model may sample the image placeholder id (one token in ~520): that rollout's ids then
    # hold an image run with no image, and it is dropped as invalid (a known limitation). Nothing else drops.
    assert [m["step"] for m in metrics] == [1, 2] and all(m["trajectories"] >= 6 for m in metrics)
    assert all(abs(m["actor/vllm_kl"]) < 1e-3 for m in metrics)
    assert {k for m in metrics for k in m if k.startswith("agent/dropped")} <= {"agent/dropped_invalid"}
    dumped = read_jsonl(str(next(Path(tmp_path / "dump").glob("*.jsonl"))))
    for t in dumped:
        seg = t.segments[0]
        assert seg.images is not None and seg.images.counts == [16]
        seg.validate()
    assert (tmp_path / "run/hf/preprocessor_config.json").exists()  # the export keeps the image processor


@pytest.mark.asyncio
async def test_chat_server_takes_openai_and_anthropic_images_and_records_them(vlm):
    """Both SDKs send an image over HTTP; the recorded segment holds the expanded placeholders and the
    image, a second turn extends it (the image stays in the reused prefix), and each sampled logprob
    equals transformers' forward with that image. Bad images are 400s, a text-only model refuses them."""
    import base64
    import io

    import anthropic
    import openai
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI

    from instar.agents.server import ChatServer
    from instar.engines.embedded import EmbeddedEngine
    model, tokenizer, vision = vlm
    png = io.BytesIO()
    picture("red").save(png, format="PNG")
    b64 = base64.b64encode(png.getvalue()).decode()
    engine = EmbeddedEngine(model)
    try:
        async with ChatServer(engine, tokenizer, model_name="tiny", max_len=512, max_new_tokens=6,
                              vision=vision) as server:
            session = server.open()
            client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                {"type": "text", "text": "What is it?"}]}]
            first = await client.chat.completions.create(model="tiny", messages=messages, seed=1)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And now?"}]
            await client.chat.completions.create(model="tiny", messages=messages, seed=2)
            seg = session.transcript.segments
            assert len(seg) == 1 and seg[0].images.counts == [16]
            seg[0].validate()
            ids = seg[0].token_ids
            sampled = [i for i, m in enumerate(seg[0].action_mask) if m]
            ref = hf_logprobs(model, ids[:sampled[0]], seg[0].images, ids[sampled[0]:])
            got = [seg[0].rollout_logprobs[i] for i in range(sampled[0], len(ids))]
            mask = seg[0].action_mask[sampled[0]:]
            assert max(abs(a - b) for a, b, m in zip(got, ref, mask) if m) < 1e-4
            assert engine.stats["prefix_hit_tokens"] > 16  # the second turn reused the cached image tokens

            other = server.open()
            claude = AsyncAnthropic(base_url=other.session_url, api_key=other.api_key, max_retries=0)
            await claude.messages.create(model="tiny", max_tokens=6, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                {"type": "text", "text": "What is it?"}]}])
            assert other.transcript.segments[0].images.counts == [16]
            assert torch.equal(other.transcript.segments[0].images.pixel_values, seg[0].images.pixel_values)

            with pytest.raises(openai.BadRequestError, match="data URL"):
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
            with pytest.raises(anthropic.BadRequestError, match="not a readable image"):
                await claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
            server.vision = None
            with pytest.raises(openai.BadRequestError, match="text-only"):
                await client.chat.completions.create(model="tiny", messages=messages[:1])
    finally:
        await engine.close()


def test_view_shows_each_image_where_its_tokens_are(tmp_path, vlm, tiny_vlm_dir):
    """The page holds each image once, in place of its placeholder run, rebuilt from the dumped patches to
    the pixel (a 128x128 picture is not resized); the text around it is shown token by token."""
    import re

    from instar.cli.view import write_view
    from instar.contract import NO_VERSION, Sample, Trajectory, write_jsonl
    from instar.data.images import load_image

    _, tokenizer, vision = vlm
    red, blue = picture("red"), picture("blue", "circle")
    ids, images = image_prompt(None, tokenizer, vision, red, blue)
    answer = tokenizer.encode("2")
    n = len(ids)
    sample = Sample(ids + answer, [0] * n + [1] * len(answer), [0.0] * n + [-0.5] * len(answer),
                    [NO_VERSION] * n + [1] * len(answer), images=images)
    write_jsonl(str(tmp_path / "step_000001.jsonl"), [Trajectory([sample], 1.0, None, "r0", 0, "stop")])
    page = write_view(tmp_path, str(tiny_vlm_dir)).read_text()
    urls = re.findall(r"<img src='([^']+)' title='image: (\d+) tokens", page)
    assert [int(k) for _, k in urls] == [16, 16]
    for (url, _), original in zip(urls, (red, blue)):
        assert list(load_image(url).getdata()) == list(original.getdata())
    assert "image_pad" not in page and "What is it?" in re.sub(r"<[^>]+>", "", page)
    assert "logprob -0.5000" in page

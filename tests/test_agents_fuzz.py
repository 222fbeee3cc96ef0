"""A bounded, seeded fuzz of the chat server over loopback, on the embedded engine and a tiny model:
malformed requests across both protocols and both route kinds never get a 5xx, and after every 50
the server still answers a valid request; hostile images get a 4xx on a tiny vision-language model."""

import asyncio
import json
import random
import re
import time
from collections import Counter

import httpx
import pytest
from transformers import AutoTokenizer

from instar.agents import ChatServer, SamplingParams
from instar.engines import EmbeddedEngine

N, EVERY = 1000, 50
DEEP = "\x00deep\x00"  # a placeholder, replaced by raw nested brackets after serializing
EVIL = [None, True, 0, -1, 1.5, 1e308, -1e308, 2**63 - 1, -2**63, 2**63, 2**64, -2**63 - 1, 10**40, "", "x",
        "\ud800", "a\udfffb", "\ud83d", "é\u0000", [], {}, [None], [1, "x"], {"a": None}, {"type": "text"},
        {"type": "text", "text": 5}, {"type": "tool_use"}, {"type": "image", "source": {}},
        {"function": "calc"}, {"function": {"name": 5, "arguments": "{"}}, [{"function": {"arguments": 1}}],
        "[" * 50, "{\"a\": " * 10, DEEP]


def openai_body(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    if rng.random() < 0.5:
        call = {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2+3"}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c0", "content": [{"type": "text", "text": "5"}]}]
    return {"model": "tiny", "messages": messages, "max_tokens": 2, "stream": rng.random() < 0.3, "seed": 1,
            "tools": [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]}


def anthropic_body(rng: random.Random) -> dict:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is 2+3?"}]}]
    if rng.random() < 0.5:
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": "c0", "name": "calc",
                                                        "input": {"expression": "2+3"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c0", "content": "5"}]}]
    return {"model": "tiny", "max_tokens": 2, "system": "Be brief.", "messages": messages,
            "stream": rng.random() < 0.3, "tools": [{"name": "calc", "input_schema": {"type": "object"}}]}


def slots(node, out):
    """Every (container, key) of a JSON tree."""
    for key in range(len(node)) if isinstance(node, list) else list(node) if isinstance(node, dict) else []:
        out.append((node, key))
        slots(node[key], out)
    return out


def mutate(rng: random.Random, body: dict) -> bytes:
    for _ in range(rng.randint(1, 3)):
        parent, key = rng.choice(slots(body, []))
        op = rng.random()
        if op < 0.6:
            parent[key] = rng.choice(EVIL)
        elif op < 0.8 and isinstance(parent, dict):
            del parent[key]
        elif isinstance(parent[key], dict):
            parent[key][rng.choice(["role", "type", "text", "content", "x"])] = rng.choice(EVIL)
        elif isinstance(parent[key], list):
            parent[key].append(rng.choice(EVIL))
    depth = rng.choice([10, 300, 5000, 50_000])
    raw = json.dumps(body).replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode()
    op = rng.random()
    if op < 0.08:
        raw = raw[:rng.randrange(len(raw))]
    elif op < 0.16:
        at = rng.randrange(len(raw))
        raw = raw[:at] + rng.choice([b"\xff", b"\xed\xa0\x80", b"\x00", b"}", b'"', b"NaN"]) + raw[at:]
    elif op < 0.18:
        raw = rng.choice([b"", b"null", b"[]", b"1", b'"x"', b"{}"])
    return raw


@pytest.mark.asyncio
async def test_a_thousand_malformed_requests_get_no_5xx(tiny_model_dir):
    rng, statuses = random.Random(0), Counter()
    engine = EmbeddedEngine.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    start = time.perf_counter()
    try:
        async with ChatServer(engine, tok, model_name="tiny", max_len=256, max_new_tokens=2) as server:
            session = server.open(SamplingParams(max_tokens=2))
            async with httpx.AsyncClient(base_url=server.root, timeout=30) as http:
                for i in range(N):
                    anthropic = rng.random() < 0.5
                    route = f"/{rng.choice('su')}/{session.id}/v1/{'messages' if anthropic else 'chat/completions'}"
                    body = anthropic_body(rng) if anthropic else openai_body(rng)
                    key = session.api_key if rng.random() < 0.95 else "wrong"
                    r = await http.post(route, content=mutate(rng, body), headers={"x-api-key": key})
                    statuses[r.status_code] += 1
                    assert r.status_code < 500, (i, r.status_code, r.text)
                    if r.headers["content-type"] == "application/json":
                        error = r.json()["error"] if r.status_code >= 400 else None
                        assert error is None or error["message"] and error["type"], r.text
                    if i % EVERY == EVERY - 1:  # the server still serves
                        valid = anthropic_body(rng) if anthropic else openai_body(rng)
                        r = await http.post(route, json=valid, headers={"x-api-key": session.api_key})
                        assert r.status_code == 200, r.text
    finally:
        await engine.close()
    print(f"\nfuzz: {N} requests in {time.perf_counter() - start:.1f} s, statuses {dict(sorted(statuses.items()))}")
    assert statuses[200] > 50 and statuses[400] > 400 and statuses[401] > 10


@pytest.mark.asyncio
async def test_hostile_images_get_4xx_decoded_off_the_event_loop(tiny_vlm_dir):
    """Valid-but-hostile images (test_hostile_images.HOSTILE, and one too narrow for the image processor) sent
    to a vision-language model: each is a 400 or, animated, an answer from its first frame, in both protocols,
    decoded on a worker thread; one error never drops the connection, so a request pipelined after it is
    answered."""
    import base64
    import threading

    from PIL import Image
    from test_hostile_images import HOSTILE, png

    from instar.data.images import Vision
    threads = []
    vision = Vision.from_pretrained(tiny_vlm_dir)
    process = vision.processor
    vision.processor = lambda *a, **k: threads.append(threading.current_thread()) or process(*a, **k)
    cases = {name: (make(), expected) for name, (make, expected) in HOSTILE.items()}
    cases["1x5000"] = (png(Image.new("RGB", (1, 5000))), None)
    engine = EmbeddedEngine.from_pretrained(tiny_vlm_dir)
    try:
        async with ChatServer(engine, AutoTokenizer.from_pretrained(tiny_vlm_dir), model_name="tiny", max_len=256,
                              max_new_tokens=2, vision=vision) as server:
            session = server.open(SamplingParams(max_tokens=2))
            path, key = f"/s/{session.id}/v1", {"x-api-key": session.api_key}

            def bodies(raw):
                data = base64.b64encode(raw).decode()
                openai = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]
                claude = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]
                return [("chat/completions", {"model": "tiny", "max_tokens": 2, "stream": True,
                                              "messages": [{"role": "user", "content": openai}]}),
                        ("messages", {"model": "tiny", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": claude}]})]

            async with httpx.AsyncClient(base_url=server.root, timeout=60) as http:
                for name, (raw, expected) in cases.items():
                    for route, body in bodies(raw):
                        r = await http.post(f"{path}/{route}", json=body, headers=key)
                        assert r.status_code == (400 if expected is None else 200), (name, route, r.text)
                        assert expected or "not a readable image" in r.text or "aspect ratio" in r.text, r.text
            assert threads and threading.main_thread() not in threads  # the event loop's thread decoded none
            reader, writer = await asyncio.open_connection(*server.root.removeprefix("http://").split(":"))
            for (raw, _), last in ((cases["bomb"], False), (cases["truncated"], True)):
                body = json.dumps(bodies(raw)[1][1]).encode()
                head = f"POST {path}/messages HTTP/1.1\r\nhost: x\r\nx-api-key: {session.api_key}\r\n"
                head += f"content-length: {len(body)}\r\n" + ("connection: close\r\n" if last else "")
                writer.write(f"{head}\r\n".encode() + body)
            statuses = re.findall(rb"HTTP/1.1 (\d+)", await reader.read())  # a closed connection ends the read
            assert statuses == [b"400", b"400"]
            writer.close()
    finally:
        await engine.close()

"""Round trip of one chat request to the loopback chat server on a kept-alive connection.

The real `ChatServer` (FastAPI + uvicorn) runs in this process with a fake engine that answers every
request at once with one end-of-turn token, so the figure is the server's own latency: HTTP, JSON,
chat template, transcript. The client is httpx (what the OpenAI and Anthropic SDKs use) on one reused
connection; each request goes to the untraced route, so every one is a fresh 1-message conversation.

Two settings are timed, interleaved in rounds so load from other processes hits both alike:
* shipped: the accepted socket as the server set it up (TCP_NODELAY on since the fix);
* nagle: the same connection with TCP_NODELAY cleared on the server's side, i.e. the server before
  its fix: Nagle holds the response's second write until the client's delayed ACK (~40 ms).
The last line is `chat_rtt_ms=<median as shipped>`.

    OMP_NUM_THREADS=1 python bench/chat_latency.py [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import tempfile
import time

import httpx
from transformers import AutoTokenizer

from instar.agents import ChatServer
from instar.contract import Generation
from instar.data.tiny_model import TinySpec, build_tiny_model


class InstantEngine:
    """Answers every request with the end-of-turn token, sampled by policy version 0."""

    def __init__(self, eos: int) -> None:
        self.eos = eos

    async def generate(self, prompt_token_ids, sampling_params, session_id=None) -> Generation:
        return Generation([self.eos], [0.0], [0], "stop")


def server_socket(server: ChatServer):
    """The server's end of the one connection the client keeps alive."""
    [conn] = server._server.server_state.connections  # more than one: the client did not reuse it
    return conn.transport.get_extra_info("socket")


async def timed(client: httpx.AsyncClient, url: str, body: dict, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        r = await client.post(url, json=body)
        out.append((time.perf_counter() - start) * 1e3)
        r.raise_for_status()
    return out


async def main(requests: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp, TinySpec()))
    async with ChatServer(InstantEngine(tok.eos_token_id), tok, model_name="tiny", max_len=1024,
                          max_new_tokens=16) as server:
        session = server.open()
        url = f"{session.untraced_base_url}/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 1}
        headers = {"Authorization": f"Bearer {session.api_key}"}
        async with httpx.AsyncClient(headers=headers, timeout=10) as client:
            await timed(client, url, body, 20)  # warm-up; also opens the one connection
            sock = server_socket(server)
            shipped = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            print(f"server sets TCP_NODELAY on accepted sockets: {bool(shipped)}")
            times: dict[str, list[float]] = {"shipped": [], "nagle": []}
            # a Nagle-delayed request costs ~40 ms: time fewer of them, they vary little
            per_round = {"shipped": requests // rounds, "nagle": max(1, requests // rounds // 4)}
            for _ in range(rounds):
                for mode in ("shipped", "nagle"):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, shipped if mode == "shipped" else 0)
                    times[mode] += await timed(client, url, body, per_round[mode])
    stats = {}
    for mode, ms in times.items():
        median, p90 = statistics.median(ms), statistics.quantiles(ms, n=10)[-1]
        stats[mode] = median
        print(f"{mode:8s} {len(ms):4d} requests  median {median:7.2f} ms  p90 {p90:7.2f} ms")
    print(f"nagle/shipped median ratio: {stats['nagle'] / stats['shipped']:.1f}x")
    print(f"chat_rtt_ms={stats['shipped']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests timed as shipped")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of both settings")
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.rounds))

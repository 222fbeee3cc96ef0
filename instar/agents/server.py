"""The loopback chat server: the OpenAI (Chat Completions, Responses) and Anthropic wire protocols over
the session transcripts.

One uvicorn server runs as an asyncio task in the agent-runner process, bound to 127.0.0.1 on a free
port; the agents' own code runs on other threads (``api.on_own_thread``), so it never blocks the server.
Every rollout is a session with a random secret (the agent's ``api_key``). Traced routes
``/s/{session}/v1/...`` record into the session's transcript; untraced routes ``/u/{session}/v1/...``
use the same engine for judge and helper calls and record nothing.

A turn is all or nothing: an engine error, a bad conversation or a client that hangs up (its engine
request is cancelled) leaves the transcript as it was, so an SDK's automatic retry is exact. A streamed
turn (``stream: true``) sends its text as the engine samples it (`instar.agents.live`); its tokens are
recorded when the engine has finished it, as any other turn's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

import instar.agents.responses as responses
import instar.agents.wire as wire
from instar.agents.live import Delta, LiveText
from instar.agents.transcript import Transcript, Turn
from instar.contract import SamplingParams
from instar.data.chat import Message
from instar.data.images import Vision, image_urls
from instar.data.tool_calls import parser_named
from instar.engines.protocol import Sampled, Sampler

MAX_SESSIONS = 4096  # open at once per agent runner: each holds a transcript until its rollout ends
MAX_BODY_BYTES = 8 * 2**20  # a long agent context is ~1 MB of JSON; the body is parsed on the event loop
_TRAINED = ("temperature", "top_p", "top_k")  # what the trainer's logprob recomputation assumes


@dataclass
class Session:
    """One rollout's endpoint: its transcript, secret and the URLs the SDKs take."""

    id: str
    api_key: str
    transcript: Transcript
    sampling: SamplingParams
    model_name: str
    base_url: str  # OpenAI SDK ``base_url``
    session_url: str  # Anthropic SDK ``base_url`` (the SDK appends /v1/messages)
    untraced_base_url: str  # the same for calls that are not recorded
    untraced_session_url: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    responses: dict[str, list[Message]] = field(default_factory=dict)  # response id -> its conversation

    @property
    def untraced_id(self) -> str:
        """The engine session id of this session's untraced calls (router placement, prefix cache)."""
        return f"{self.id}/untraced"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals belong to the host process (Ray actor, pytest), not to this embedded server


class ChatServer:
    """Serves every session of one agent-runner process. Use ``async with ChatServer(...)``."""

    def __init__(self, engine: Sampler, tokenizer: Any, *, model_name: str, max_len: int, max_new_tokens: int,
                 max_sessions: int = MAX_SESSIONS, max_body_bytes: int = MAX_BODY_BYTES,
                 tool_parser: str = "hermes", vision: Vision | None = None) -> None:
        self.engine, self.tokenizer, self.model_name, self.vision = engine, tokenizer, model_name, vision
        self.tool_parser = parser_named(tool_parser).name  # an unknown name fails here, not per request
        # looked up once: transformers resolves a special token's id by name on every read (~12% of a
        # single-turn rollout's CPU in the agent runner when each session's transcript asked)
        self.stop_token_ids = None if tokenizer is None else [tokenizer.eos_token_id]
        self.max_len, self.max_new_tokens = max_len, max_new_tokens
        self.max_sessions, self.max_body_bytes = max_sessions, max_body_bytes
        self.sessions: dict[str, Session] = {}
        self.root = ""
        self.app = build_app(self)
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> ChatServer:
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP
        # (proto 0 inherits), and without it Nagle + delayed ACK hold each response ~40 ms.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.root = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start-up error
                raise RuntimeError(f"chat server on {self.root} stopped during start-up")
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task

    def transcript(self, session_id: str) -> Transcript:
        return Transcript(self.engine, self.tokenizer, session_id=session_id, max_len=self.max_len,
                          max_new_tokens=self.max_new_tokens, stop_token_ids=self.stop_token_ids,
                          tool_parser=self.tool_parser, vision=self.vision)

    def open(self, sampling: SamplingParams | None = None) -> Session:
        """A new session with a fresh transcript and secret; ``close`` it when the rollout ends."""
        if len(self.sessions) >= self.max_sessions:
            raise RuntimeError(f"{len(self.sessions)} chat sessions are open on this agent runner, the cap: close each "
                               "session when its rollout ends (ChatServer.close), run fewer rollouts per runner at "
                               "once, or raise ChatServer(max_sessions=...)")
        sid = uuid.uuid4().hex
        traced, untraced = f"{self.root}/s/{sid}", f"{self.root}/u/{sid}"
        session = Session(sid, secrets.token_urlsafe(24), self.transcript(sid), sampling or SamplingParams(),
                          self.model_name, f"{traced}/v1", traced, f"{untraced}/v1", untraced)
        self.sessions[sid] = session
        return session

    def close(self, session: Session) -> None:
        self.sessions.pop(session.id, None)


def _authorize(server: ChatServer, request: Request, session_id: str) -> Session:
    session = server.sessions.get(session_id)
    if session is None:
        raise wire.WireError(404, f"unknown session {session_id!r} (closed, or never opened by this agent runner)")
    auth = request.headers.get("authorization", "")
    key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(key.encode(), session.api_key.encode()):
        raise wire.WireError(401, "wrong api key for this session: use ctx.api_key (Authorization: Bearer or "
                                  "x-api-key)")
    return session


async def _body(server: ChatServer, request: Request, model: type[BaseModel]) -> Any:
    """Parse after authorizing, so a caller with a wrong key learns nothing about the body rules.
    pydantic's JSON parser refuses lone surrogates and deep nesting, which the tokenizer and the
    template would otherwise fail on."""
    raw = bytearray()
    async for chunk in request.stream():  # counted as it arrives: a chunked body has no Content-Length
        raw += chunk
        if len(raw) > server.max_body_bytes:
            raise wire.WireError(413, f"the request body is over {server.max_body_bytes} bytes, the limit of this "
                                      "chat server")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        detail = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" if err["loc"] else err["msg"]
                           for err in e.errors()[:4])
        raise wire.WireError(400, f"invalid request body: {detail}") from None


def _sampling(session: Session, traced: bool, body: wire.BaseRequest, **asked: Any) -> SamplingParams:
    """The session's sampling, overridden by what the request sets explicitly. A traced turn must
    keep the session's distribution: the trainer's importance ratios assume it."""
    asked = {"temperature": body.temperature, "top_p": body.top_p, **asked}
    asked = {k: v for k, v in asked.items() if v is not None}
    changed = [f"{k}={asked[k]} differs from this session's {getattr(session.sampling, k)}" for k in _TRAINED
               if k in asked and asked[k] != getattr(session.sampling, k)]
    if traced and changed:
        raise wire.WireError(400, "; ".join(changed) + ": a traced turn is trained on, and the trainer recomputes its "
                             "logprobs with the session's sampling (--rollout.temperature and friends): leave these "
                             "unset or equal to the session's, or send this request to the untraced URL "
                             "(ctx.untraced_base_url / ctx.untraced_session_url)")
    return session.sampling.replace(**asked)


async def _live(text: LiveText, sample: Callable[..., Awaitable[Turn]]) -> AsyncIterator[Delta | Turn]:
    """The text deltas of the turn ``sample(on_tokens)`` samples, as the engine samples it, then the Turn;
    closing it early cancels the turn."""
    parts: asyncio.Queue = asyncio.Queue()

    def on_tokens(prompt_ids: list[int], sampled: Sampled) -> None:
        for delta in text.add(prompt_ids, sampled):
            parts.put_nowait(delta)

    turn = asyncio.ensure_future(sample(on_tokens))
    turn.add_done_callback(lambda _: parts.put_nowait(None))  # after every delta it put
    try:
        while (part := await parts.get()) is not None:
            yield part
        for part in text.rest(turn.result()):
            yield part
        yield turn.result()
    finally:
        turn.cancel()  # a no-op once it finished; else the client hung up (and its engine request goes)


async def _stream(request: Request, parts: AsyncIterator[Delta | Turn],
                  events: Callable[[AsyncIterator[Delta | Turn]], AsyncIterator[tuple[str | None, Any]]]
                  ) -> StreamingResponse:
    """Server-sent ``events`` (name or None, data: JSON, or a string sent as it is) of a streamed turn. The
    response starts with the first text (or the end of the turn), so a turn that fails before it gets the
    protocol's error status."""
    first = await _unless_disconnected(request, anext(parts))

    async def resumed() -> AsyncIterator[Delta | Turn]:
        yield first
        async with contextlib.aclosing(parts):
            async for part in parts:
                yield part

    async def lines() -> AsyncIterator[str]:
        async for name, data in events(resumed()):  # Starlette cancels this when the client hangs up
            data = data if isinstance(data, str) else json.dumps(data)
            yield (f"event: {name}\n" if name else "") + f"data: {data}\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


async def _unless_disconnected(request: Request, sample: Awaitable[Any]) -> Any:
    """Run a turn, cancelling it (and so its engine request) when the client hangs up first."""
    async def hang_up() -> None:  # the body is read: the next ASGI message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    turn, gone = asyncio.ensure_future(sample), asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait([turn, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        turn.cancel()  # a no-op once it finished; else the client hung up first (or the server stops)
        await asyncio.wait([turn])  # the session lock is released only after the turn has unwound
    if turn.cancelled():
        raise wire.WireError(499, "the client closed the connection before the turn was sampled")
    try:
        return turn.result()
    except TemplateError as e:
        raise wire.WireError(400, f"the chat template rejected these messages: {e}") from None


def _error_response(request: Request, e: Exception) -> JSONResponse:
    """Every error in the calling protocol's JSON shape; an unexpected one is a 500 (and uvicorn logs it)."""
    status, message = ((e.status, e.message) if isinstance(e, wire.WireError) else
                       (e.status_code, str(e.detail)) if isinstance(e, HTTPException) else
                       (500, f"internal error: {type(e).__name__}: {e}"))
    if request.url.path.endswith("/messages"):
        kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(
            status, "api_error" if status >= 500 else "invalid_request_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)


def _encode(vision: Vision, urls: list[str]) -> None:
    for k, url in enumerate(urls):
        try:
            vision.encode(url)
        except ValueError as e:  # unreadable (a ConfigError), or refused by the image processor (aspect ratio)
            raise wire.WireError(400, f"image {k} of the conversation: {str(e).removeprefix('image: ')}") from None


def _chat_completions(session: Session, traced: bool, body: wire.OpenAIRequest) -> tuple:
    messages = wire.openai_messages(body.messages)
    sampling = _sampling(session, traced, body, max_tokens=body.max_completion_tokens or body.max_tokens,
                         seed=body.seed)
    return messages, wire.openai_tools(body.tools), sampling, None


def _messages(session: Session, traced: bool, body: wire.AnthropicRequest) -> tuple:
    messages = wire.anthropic_messages(body.system, body.messages)
    sampling = _sampling(session, traced, body, top_k=body.top_k, max_tokens=body.max_tokens)
    return messages, wire.anthropic_tools(body.tools), sampling, None


def _responses(session: Session, traced: bool, body: responses.ResponsesRequest) -> tuple:
    previous = body.previous_response_id
    if previous is not None and previous not in session.responses:
        raise wire.WireError(404, f"previous_response_id {previous!r} is not a response of this session (responses "
                                  "are kept per rollout session, until it ends); send the whole conversation as input "
                                  "instead")
    convo = responses.conversation(body, session.responses.get(previous, []))
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    sampling = _sampling(session, traced, body, max_tokens=body.max_output_tokens)
    return system + convo, responses.tools(body), sampling, convo


# path, request body, its reading (messages, tools, sampling and the conversation a later previous_response_id
# continues, or None), the response, the stream events, the response id's prefix
_PROTOCOLS = (
    ("chat/completions", wire.OpenAIRequest, _chat_completions, wire.openai_response, wire.openai_chunks, "chatcmpl-"),
    ("messages", wire.AnthropicRequest, _messages, wire.anthropic_response, wire.anthropic_events, "msg_"),
    ("responses", responses.ResponsesRequest, _responses, responses.response, responses.events, "resp_"),
)


def build_app(server: ChatServer) -> FastAPI:
    app = FastAPI(title="instar loopback chat server", openapi_url=None, docs_url=None, redoc_url=None)

    for error in (wire.WireError, HTTPException, Exception):
        app.add_exception_handler(error, _error_response)

    def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "instar"}]}

    app.get("/v1/models")(models)

    def route(traced: bool, body_model: type[BaseModel], read: Callable, respond: Callable, events: Callable,
              id_prefix: str) -> Callable:
        async def handler(session_id: str, request: Request) -> Any:
            session = _authorize(server, request, session_id)
            body = await _body(server, request, body_model)
            messages, tools, sampling, kept = read(session, traced, body)
            wire.refuse_ignored(body, tools)  # on untraced routes too: the engines have none of these either
            if messages[-1]["role"] == "assistant":
                raise wire.WireError(400, "the last message is from the assistant; end with a user or tool message "
                                          "(continuing a partial assistant turn is not supported)")
            if (urls := image_urls(messages)) and server.vision is None:
                raise wire.WireError(400, f"model {server.model_name!r} is text-only: it takes no images")
            if urls:  # decoded here, off the event loop, into the vision's cache where the transcript finds them
                await asyncio.to_thread(_encode, server.vision, urls)
            rid = f"{id_prefix}{uuid.uuid4().hex}"

            async def sample(on_tokens: Callable[[list[int], Sampled], None] | None = None) -> Turn:
                # untraced: a throwaway transcript, same engine and template, nothing recorded
                transcript = session.transcript if traced else server.transcript(session.untraced_id)
                async with session.lock if traced else contextlib.nullcontext():
                    turn = await transcript.sample(messages, tools, sampling, on_tokens)
                if kept is not None:  # the Responses API: what a later previous_response_id continues
                    session.responses[rid] = [*kept, turn.message]
                return turn

            if body.stream:
                live = LiveText(server.tokenizer, parser_named(server.tool_parser).starts)
                return await _stream(request, _live(live, sample), lambda p: events(p, body.model, rid))
            return respond(await _unless_disconnected(request, sample()), body.model, rid)
        return handler

    for prefix, traced in (("/s", True), ("/u", False)):
        app.get(prefix + "/{session_id}/v1/models")(models)
        for path, *protocol in _PROTOCOLS:
            app.post(f"{prefix}/{{session_id}}/v1/{path}")(route(traced, *protocol))
    return app

"""The HTTP routes: thin. Validation is protocol.py's, engine work serving.py's, the model the engine thread's.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (503 while loading, and after a
fatal failure of the engine), GET /metrics, POST /tokenize, POST /detokenize, and the playground page at / (with its
icon at /favicon.ico). Every error is an OpenAI-shaped JSON body. A POST body is read as JSON whatever its
Content-Type says (curl -d sends application/x-www-form-urlencoded), and fields a request model does not know are
ignored with a warning in the log, as OpenAI's clients expect of a server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.errors import GPT2EngineError, one_line
from ..interp.steering import SteeringRegistry
from .async_engine import AsyncEngine
from .chat import ChatTemplate, plain_template
from .metrics import CONTENT_TYPE
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import ChatRun, CompletionRun, chat_prompt, chat_requests, engine_requests

log = logging.getLogger(__name__)

# the page's icon: a tiny SVG, so that a browser's request for it is answered (no 404 in its console)
FAVICON = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" '
           'fill="#2a5db0"/><text x="8" y="12" font-size="10" text-anchor="middle" fill="#fff" '
           'font-family="sans-serif">2</text></svg>')


class ServeError(GPT2EngineError):
    """Bad server options."""


@dataclass
class ServerSettings:
    model_name: str = "gpt2"
    adapters: tuple[tuple[str, Path], ...] = ()  # LoRA adapters served next to the base: (model id, directory)
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    body_seconds: float = 30.0  # the longest wait for the next piece of a request's body (nginx's client_body_timeout)
    replica: str | None = None  # under Ray Serve: this replica's id, sent as the x-gpt2-replica response header
    chat_template: ChatTemplate = field(default_factory=plain_template)
    steering: SteeringRegistry = field(default_factory=SteeringRegistry)  # --sae, --steering-vector: by name


@dataclass
class ServerState:
    """What the routes share: the loaded model and its engine (None while loading), or why loading failed."""

    settings: ServerSettings
    model: Any = None
    engine: AsyncEngine | None = None
    load_error: str | None = None
    started: float = field(default_factory=time.time)


BODY_PIECES = 4  # a body may take this many times body_seconds in all (2 minutes by default; 1 MiB at ~9 KB/s)
HEADER_SECONDS = 30.0  # a request's headers, from its first byte (or the connection's opening) to their end


def http_protocol(header_seconds: float = HEADER_SECONDS) -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11) with a bound on the time a request's headers
    take: uvicorn bounds only the idle time between keep-alive requests, so a client that opens connections and never
    finishes its headers held each, and the process's file descriptors with it, as long as it liked (20,000 of them
    left every other client a connection reset). A connection whose headers are not in within `header_seconds` is
    closed; the body's pace is Gate's."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.header_timer = self.loop.call_later(header_seconds, self.headers_too_slow)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            waiting = self.cycle is None or self.cycle.response_complete  # no request's headers complete yet
            if not waiting and self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None
            elif waiting and self.header_timer is None and data:  # the next keep-alive request has begun
                self.header_timer = self.loop.call_later(header_seconds, self.headers_too_slow)

        def headers_too_slow(self) -> None:
            self.header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None
            super().connection_lost(exc)

    return HeaderDeadline


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class Gate:
    """ASGI middleware in front of every route: the API key (all routes but /health and the page at /), then the body
    size limit (413, by Content-Length or as the body streams in) and its pace (408 when no piece of it comes for
    `body_seconds`: a client that sends a byte and stops would hold its connection and buffers for as long as it
    likes). Pure ASGI on purpose: Starlette's BaseHTTPMiddleware reports a disconnect to streaming responses it
    wraps, which would cut streams short."""

    def __init__(self, app: Callable, api_key: str | None, limit: int, replica: str | None = None,
                 body_seconds: float = 30.0) -> None:
        self.app, self.api_key, self.limit, self.body_seconds = app, api_key, limit, body_seconds
        self.replica = replica.encode() if replica else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = self.tagged(send)
        headers = dict(scope.get("headers") or [])
        if scope["method"] == "POST" and not headers.get(b"content-type", b"").startswith(b"application/json"):
            # every POST route takes JSON: read the body as JSON whatever the client declared
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        if (refused := self.refusal(scope, headers)) is not None:
            return await error_response(refused)(scope, receive, send)
        too_large = APIError(413, f"request body is larger than {self.limit} bytes", code="request_too_large")
        too_slow = APIError(408, f"the request body stopped arriving for {self.body_seconds:g} s",
                            code="request_timeout")
        total = BODY_PIECES * self.body_seconds  # a byte every 29 s would hold the connection for ever
        too_long = APIError(408, f"the request body took over {total:g} s to arrive", code="request_timeout")
        seen, refused, whole, started = 0, None, False, None

        async def limited() -> dict:
            nonlocal seen, refused, whole, started
            if whole:  # the body is in: a streaming route waits here for the client's disconnect, unbounded
                return await receive()
            started = started or time.monotonic()
            left = total - (time.monotonic() - started)
            try:
                message = await asyncio.wait_for(receive(), min(self.body_seconds, max(left, 0.0)))
            except asyncio.TimeoutError:
                refused = too_slow if left > self.body_seconds else too_long
                raise refused from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                refused = too_large
                raise too_large
            return message

        async def answer(message: dict) -> None:
            # a body without Content-Length (chunked) goes over as it streams in, where FastAPI turns the raise
            # above into its own 400 about parsing: the 413 (or 408) is sent in its place
            if refused is None:
                await send(message)
            elif message["type"] == "http.response.start":
                await error_response(refused)(scope, receive, send)

        await self.app(scope, limited, answer)

    def tagged(self, send: Callable) -> Callable:
        """`send`, adding which replica answered to each response's headers (for clients and tests of a Ray
        deployment); `send` itself outside Ray."""
        if self.replica is None:
            return send

        async def send_tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-gpt2-replica", self.replica)]}
            await send(message)

        return send_tagged

    def refusal(self, scope: dict, headers: dict[bytes, bytes]) -> APIError | None:
        """Why a request is refused before it reaches a route: no valid API key (every route but /health and the
        page), a Content-Length over the limit, or a compressed body; None to let it through."""
        if self.api_key and scope["path"] not in ("/health", "/", "/favicon.ico") and scope["method"] != "OPTIONS":
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given, self.api_key.encode()):  # RFC 7235: any case
                return APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                type="authentication_error", code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return APIError(413, f"request body is larger than {self.limit} bytes", code="request_too_large")
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if scope["method"] == "POST" and encoding != b"identity":  # a compressed body is not read as JSON, nor inflated
            return APIError(415, f"Content-Encoding {encoding.decode('latin-1')[:40]} is not supported; send the JSON "
                                 "body uncompressed", code="unsupported_encoding")
        return None


def build_app(state: ServerState, load: Callable[[], tuple[Any, AsyncEngine]] | None = None) -> Gate:
    """The FastAPI app over `state` (the routes below reach it as request.app.state.server). With `load`, the model
    loads in a thread at startup (/health is 503 until then)."""

    async def lifespan(app: FastAPI):
        if load is not None:
            threading.Thread(target=load_into, args=(state, load), name="gpt2-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.stop()
        state.settings.chat_template.close()

    app = FastAPI(title="gpt2-engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    settings = state.settings
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    for kind, handler in ERROR_HANDLERS:
        app.add_exception_handler(kind, handler)
    for method, path, handler, response_class in ROUTES:
        app.add_api_route(path, handler, methods=[method], response_class=response_class)
    return Gate(app, settings.api_key, settings.max_body_bytes, settings.replica, settings.body_seconds)


def load_into(state: ServerState, load: Callable[[], tuple[Any, AsyncEngine]]) -> None:
    """The model and its engine loaded into `state`, or why not (which /health and every route then report)."""
    try:
        state.model, state.engine = load()
    except Exception as e:  # noqa: BLE001 - reported by /health and every route
        state.load_error = one_line(e, 300)


# --- errors, in OpenAI's shape ---------------------------------------------------------------------------------------


async def api_error(_: Request, err: APIError) -> JSONResponse:
    return error_response(err)


# pydantic's strict type errors, as what the field expects (a JSON value, named as JSON writes it)
EXPECTED = {"bool_type": "true or false", "int_type": "an integer", "float_type": "a number", "string_type": "a string"}


async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
    """A request model's validation error as a 400 naming the field (or the APIError a validator raised), and for a
    value of the wrong type what was given and what is expected."""
    errors = err.errors()
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if isinstance(first.get("ctx", {}).get("error"), APIError):  # raised inside a model validator
        return error_response(first["ctx"]["error"])
    param = loc[0] if loc else None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    where = ".".join(loc)
    if first.get("type") == "json_invalid":  # loc holds the byte offset, not a field
        message, param, where = "the body is not valid JSON", None, ""
    elif first.get("type") == "missing" and not loc:  # no body at all
        message = "the body is empty: expected a JSON object"
    elif first.get("type") in EXPECTED and len(errors) == 1:  # one type (a union's members each report their own)
        given = json.dumps(first.get("input"), ensure_ascii=False)
        message = f"expected {EXPECTED[first['type']]}, got {given if len(given) <= 60 else given[:57] + '...'}"
    return error_response(APIError(400, f"{where}: {message}" if where else message, param=param))


UNREADABLE_BODY = "There was an error parsing the body"


async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(err.status_code, "invalid_request_error")
    message = {404: "no such route", 405: "method not allowed on this route"}.get(err.status_code, str(err.detail))
    if message == UNREADABLE_BODY:  # FastAPI's words for a body json.loads raised other than JSONDecodeError on
        message = ("the body could not be read as JSON (its text is not UTF-8, its values nest too deeply, or an "
                   "integer has over 4,300 digits)")
    return error_response(APIError(err.status_code, message, type=kind))


async def internal_error(_: Request, err: Exception) -> JSONResponse:
    return error_response(APIError(500, f"internal error: {type(err).__name__}", type="server_error"))


ERROR_HANDLERS = ((APIError, api_error), (RequestValidationError, invalid), (StarletteHTTPException, http_error),
                  (Exception, internal_error))


# --- what every route checks ---------------------------------------------------------------------------------------


def server_of(request: Request) -> ServerState:
    return request.app.state.server


def ignoring(route: str, fields: list[str]) -> None:
    """Log a request's unknown fields: the first few, each cut short (a client must not write its body to the log)."""
    if fields:
        shown = ", ".join(repr(f[:40] + "..." if len(f) > 40 else f) for f in fields[:5])
        more = f" and {len(fields) - 5:,} more" if len(fields) > 5 else ""
        log.warning("%s: ignoring %d unknown field(s): %s%s", route, len(fields), shown, more)


def ready(state: ServerState) -> tuple[Any, AsyncEngine]:
    """The model and its engine; a 503 while loading, after a failed load, or after the engine failed."""
    if state.load_error:
        raise APIError(503, f"the model failed to load: {state.load_error}", type="service_unavailable",
                       code="load_failed")
    if state.engine is None:
        raise APIError(503, "the model is loading; retry shortly", type="service_unavailable", code="loading",
                       headers={"Retry-After": "1"})
    if state.engine.failure is not None:
        raise APIError(503, state.engine.failure, type="service_unavailable", code="engine_failed")
    return state.model, state.engine


def check_model(settings: ServerSettings, name: str | None) -> int | None:
    """The weights' adapter a request names: None for the base where no adapters are served, else -1 for the base
    and i for the i-th adapter (as the runner's rows take them); 404 for a name this server does not serve."""
    names = [settings.model_name] + [name for name, _ in settings.adapters]
    if name is not None and name not in names:
        served = ", ".join(repr(n) for n in names)
        shown = repr(name) if len(name) <= 200 else f"{name[:200]!r}... ({len(name):,} characters)"
        raise APIError(404, f"the model {shown} does not exist; this server serves {served}",
                       param="model", code="model_not_found")
    if not settings.adapters:
        return None
    return -1 if name in (None, settings.model_name) else names.index(name) - 1


# --- the routes ------------------------------------------------------------------------------------------------------


async def health(request: Request) -> JSONResponse:
    ready(server_of(request))
    return JSONResponse({"status": "ok"})


async def models(request: Request) -> dict:
    state = server_of(request)
    settings = state.settings
    base = {"id": settings.model_name, "object": "model", "created": int(state.started), "owned_by": "gpt2-engine"}
    # adapters as vLLM lists its LoRA modules: their own id, the base as parent, the directory as root
    return {"object": "list", "data": [base] + [{**base, "id": name, "root": str(path), "parent": settings.model_name}
                                                for name, path in settings.adapters]}


async def steering(request: Request) -> dict:
    """The SAEs and vectors requests may steer with (their "steering" field names them)."""
    return {"object": "steering", **server_of(request).settings.steering.describe()}


async def metrics(request: Request) -> Response:
    state = server_of(request)
    if state.engine is None:
        ready(state)
    return Response(state.engine.metrics.render(), media_type=CONTENT_TYPE)


async def tokenizer_info(request: Request) -> dict:
    """What lm-eval's remote tokenizer (and vLLM's endpoint of this name) reports: GPT-2's special tokens as Hugging
    Face's GPT2Tokenizer names them (<|endoftext|> is its bos, eos and unk; it has no pad)."""
    model, _ = ready(server_of(request))
    eot = model.tokenizer.decode([model.tokenizer.eot_id])
    return {"tokenizer_class": "GPT2Tokenizer", "eos_token": eot, "bos_token": eot, "unk_token": eot,
            "pad_token": None, "model_max_length": model.config.n_positions, "vocab_size": model.tokenizer.n_vocab}


async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """Token ids of a text, or of a conversation's prompt as /v1/chat/completions renders it; `<|endoftext|>` in a
    text is the special token, as a Hugging Face tokenizer reads it (so lm-eval's remote tokenizer finds the eos
    id). GPT-2 adds no special tokens, so add_special_tokens changes nothing."""
    state = server_of(request)
    ignoring("/tokenize", sorted(body.model_extra or {}))
    check_model(state.settings, body.model)
    model, _ = ready(state)
    tokens = model.tokenizer.encode(body.prompt, allow_special=True) if body.messages is None else \
        await chat_prompt(body.messages, state.settings.chat_template, model.tokenizer)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": model.config.n_positions}


async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = server_of(request)
    ignoring("/detokenize", sorted(body.model_extra or {}))
    check_model(state.settings, body.model)
    model, _ = ready(state)
    if any(not 0 <= t < model.tokenizer.n_vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {model.tokenizer.n_vocab})", param="tokens")
    return {"prompt": model.tokenizer.decode(body.tokens)}


async def completions(body: CompletionRequest, request: Request) -> Any:
    state = server_of(request)
    settings = state.settings
    ignoring("/v1/completions", body.ignored())
    adapter = check_model(settings, body.model)
    model, engine = ready(state)
    run = CompletionRun(engine, model.tokenizer, body, body.model or settings.model_name,
                        await engine_requests(body, model.tokenizer, model.config, adapter, model.grammars,
                                              settings.steering))
    return await respond(run, body.stream, request)


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = server_of(request)
    settings = state.settings
    ignoring("/v1/chat/completions", body.ignored())
    adapter = check_model(settings, body.model)
    model, engine = ready(state)
    run = ChatRun(engine, model.tokenizer, body, body.model or settings.model_name,
                  await chat_requests(body, settings.chat_template, model.tokenizer, model.config, adapter,
                                      model.grammars, settings.steering))
    return await respond(run, body.stream, request)


async def playground() -> HTMLResponse:
    page = resources.files("gpt2_engine.serve") / "playground.html"
    return HTMLResponse(page.read_text(encoding="utf-8") if page.is_file() else "<!doctype html><title>gpt2-engine</title>")


async def favicon() -> Response:
    return Response(FAVICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})


# (method, path, handler, response class): the whole API
ROUTES = (
    ("GET", "/health", health, JSONResponse),
    ("GET", "/v1/models", models, JSONResponse),
    ("GET", "/v1/steering", steering, JSONResponse),
    ("GET", "/metrics", metrics, Response),
    ("GET", "/tokenizer_info", tokenizer_info, JSONResponse),
    ("POST", "/tokenize", tokenize, JSONResponse),
    ("POST", "/detokenize", detokenize, JSONResponse),
    ("POST", "/v1/completions", completions, JSONResponse),
    ("POST", "/v1/chat/completions", chat_completions, JSONResponse),
    ("GET", "/", playground, HTMLResponse),
    ("GET", "/favicon.ico", favicon, Response),
)


async def respond(run: CompletionRun, stream: bool, request: Request) -> Any:
    if stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await watch_disconnect(request, run)


async def watch_disconnect(request: Request, run: CompletionRun) -> Any:
    """Wait for a whole completion, cancelling it (freeing its slots) if the client disconnects first."""
    import asyncio

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(run.whole()), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        run.cancel()
        work.cancel()
        return error_response(APIError(499, "the client disconnected", code="client_disconnected"))  # nobody reads it
    finally:
        watch.cancel()

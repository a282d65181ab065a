"""From a validated completion or chat request to engine work and back: prompts (or a conversation, through the chat
template) to token ids, parameters to Requests, and the engine's events to OpenAI responses (whole or as server-sent
events). A chat completion is a completion of the rendered conversation: the same requests, the same events, another
response shape."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import partial

from ..core.config import GPT2Config
from ..core.errors import GenerationError
from ..interp.steering import SteeringRegistry
from ..core.tokenizer import Tokenizer
from ..runtime.constraints import Grammars, grammar_failure
from ..runtime.plan import Event
from ..runtime.requests import GenerationSettings, Request, build_requests, encode_prompts
from ..runtime.sampling import SamplingParams
from .async_engine import AsyncEngine, EngineDown, Handle, QueueFull
from .chat import ChatTemplate, ChatTemplateError, TemplateFailed
from .protocol import (APIError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatMessage,
                       ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatResponseMessage, Choice,
                       CompletionRequest, CompletionResponse, Logprobs, PromptTokensDetails, SamplingFields,
                       TokenLogprob, TopLogprob, Usage)

# the engine's names for the settings OpenAI's API calls otherwise
API_PARAM = {"max_new_tokens": "max_tokens", "num_samples": "n", "top_logprobs": "logprobs"}


def api_error(e: GenerationError, status: int = 400, req: SamplingFields | None = None) -> APIError:
    """The engine's error in the API's words: its field names, without the command line's advice."""
    param = API_PARAM.get(e.param, e.param)
    if e.param == "constraint" and req is not None:
        param = req.constraint_field()
    message = e.bare
    if e.param in API_PARAM and message.startswith(e.param):
        message = param + message[len(e.param):]
    return APIError(status, message, param=param)


async def engine_requests(req: CompletionRequest, tokenizer: Tokenizer, config: GPT2Config,
                          adapter: int | None = None, grammars: Grammars | None = None,
                          registry: SteeringRegistry | None = None) -> list[Request]:
    """The request's sequences, through the engine's one request builder: n per prompt, choice j of a prompt drawing
    with seed + j (a random seed when none is given), each with the LoRA adapter its `model` named and the steering
    its "steering" field names (`registry`: the server's SAEs and vectors). Every bad value is a 400 that names its
    field."""
    try:
        prompts = encode_prompts(req.prompt, tokenizer)
    except GenerationError as e:
        raise api_error(e) from None
    return await sequences(req, prompts, req.new_tokens(16), req.logprobs, req.echo and req.logprobs is not None, (),
                           tokenizer, config, adapter, grammars, registry)


async def chat_requests(req: ChatCompletionRequest, template: ChatTemplate, tokenizer: Tokenizer, config: GPT2Config,
                        adapter: int | None = None, grammars: Grammars | None = None,
                        registry: SteeringRegistry | None = None) -> list[Request]:
    """The conversation rendered by the chat template as one prompt, continued up to the context unless
    max_completion_tokens says fewer, stopping also at the template's end of turn. The rendered text is tokenized
    as transformers does a chat template's output: an <|endoftext|> in it is the special token."""
    ids = await chat_prompt(req.messages, template, tokenizer)
    top = (req.top_logprobs or 0) if req.logprobs else None
    stops = template.stops if req.constraint() is None else ()  # a grammar decides where a structured reply ends
    return await sequences(req, [ids], req.new_tokens(config.n_positions), top, False, stops, tokenizer, config,
                           adapter, grammars, registry)


async def chat_prompt(messages: list[ChatMessage], template: ChatTemplate, tokenizer: Tokenizer) -> list[int]:
    """The conversation's prompt ids: rendered by the chat template, tokenized as transformers does a chat template's
    output (an <|endoftext|> in it is the special token). A template that fails is the server's 500; one that
    refuses the messages (raise_exception) the client's 400."""
    turns = [{"role": m.role, "content": m.text} for m in messages]

    def ids() -> list[int]:
        return tokenizer.encode(template.render(turns, tokenizer.decode([tokenizer.eot_id])), allow_special=True)

    try:  # in a thread, the tokenizing too: a slow template or a long prompt must not hold every other client
        return await asyncio.to_thread(ids)
    except TemplateFailed as e:
        raise APIError(500, str(e), type="server_error", code="chat_template_failed") from None
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", param="messages") from None


async def sequences(req: SamplingFields, prompts: list[list[int]], max_new_tokens: int, top_logprobs: int | None,
                    prompt_logprobs: bool, more_stops: tuple[str, ...], tokenizer: Tokenizer, config: GPT2Config,
                    adapter: int | None, grammars: Grammars | None, registry: SteeringRegistry | None) -> list[Request]:
    """The request's Requests. A grammar not yet cached is compiled on a worker thread (in a process of its own
    first: runtime/constraints.py), so that neither this event loop nor the engine thread waits for it."""
    try:
        steering = (registry or SteeringRegistry()).build(req.steering, config) if req.steering else ()
        bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p, req.repetition_penalty,
                                  req.presence_penalty, req.frequency_penalty, bias)
        settings = GenerationSettings(max_new_tokens=max_new_tokens, sampling=sampling, stop=req.stops + more_stops,
                                      ignore_eos=req.ignore_eos, seed=req.seed, num_samples=req.n,
                                      top_logprobs=top_logprobs or 0, prompt_logprobs=prompt_logprobs,
                                      constraint=req.constraint(), steering=steering)
        build = partial(build_requests, prompts, settings, config, tokenizer.eot_id, grammars)
        if settings.constraint is None:
            requests = build().requests
        else:  # on the grammars' own threads: see Grammars.executor
            requests = (await asyncio.get_running_loop().run_in_executor(grammars.executor, build)).requests
    except GenerationError as e:
        raise api_error(e, req=req) from None
    return requests if adapter is None else [replace(r, adapter=adapter) for r in requests]


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    prompt: list[int]
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: Logprobs | None = None
    offset: int = 0  # characters of text so far, for text_offset
    echoed: bool = False
    cached: int = 0  # prompt tokens the prefix cache held
    # each logprobs entry as the engine gave it: (token id, logprob, top (id, logprob) pairs), for the chat shape
    entries: list[tuple[int, float | None, list[tuple[int, float]] | None]] = field(default_factory=list)


class CompletionRun:
    """One /v1/completions request in the engine: submit, then read its events as whole or streamed responses."""

    id_prefix = "cmpl-"

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, req: CompletionRequest | ChatCompletionRequest,
                 model_name: str, requests: list[Request]) -> None:
        """Submit the requests to the engine (429 when it holds too many, 503 once it has failed)."""
        self.engine, self.tok, self.req, self.model_name = engine, tokenizer, req, model_name
        self.requests = requests
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.echo = isinstance(req, CompletionRequest) and req.echo
        logprobs = req.logprobs is not None if isinstance(req, CompletionRequest) else req.logprobs
        self.choices = [ChoiceState(i, r.prompt, logprobs=Logprobs() if logprobs else None)
                        for i, r in enumerate(requests)]
        self.errors: dict[int, str] = {}  # choice index -> what failed, for the 500
        try:
            self.handle: Handle = engine.submit(requests)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineDown as e:
            raise APIError(503, str(e), type="service_unavailable", code="engine_failed") from None
        except GenerationError as e:  # fits the model, but not the server's cache
            raise api_error(e) from None

    def cancel(self) -> None:
        if any(c.finish_reason is None for c in self.choices):
            self.engine.cancel(self.handle)

    def usage(self) -> Usage:
        prompt = sum(len(r.prompt) for r in self.requests[:: self.req.n])  # each prompt once, whatever n is
        completion = sum(len(c.tokens) for c in self.choices)
        cached = sum(c.cached for c in self.choices[:: self.req.n])  # as prompt_tokens: each prompt's first run
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def _add_logprob(self, c: ChoiceState, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
                     rank: int | None, in_text: bool = True) -> None:
        text = self.tok.token_text(token)
        c.entries.append((token, logprob, top))
        lp = c.logprobs
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob)
        lp.top_logprobs.append(None if top is None else {self.tok.token_text(t): v for t, v in top})
        lp.text_offset.append(c.offset)
        lp.token_ranks.append(None if rank is None else rank + 1)  # the engine counts the likelier tokens: 0 = argmax
        c.offset += len(text) if in_text else 0

    def _apply(self, i: int, e: Event) -> list[tuple[str, int, int]]:
        """Fold an event into choice i; returns the pieces it adds, for stream chunks, as (text, first and end
        logprobs entry): with echo, the prompt first as a piece of its own, then the new token."""
        c = self.choices[i]
        c.cached = max(c.cached, e.cached_tokens)
        pieces: list[tuple[str, int, int]] = []
        failed = e.finish_reason in ("shutdown", "queue_timeout", "cancelled", "error")
        if e.finish_reason == "error":
            self.errors[i] = e.error or "unknown error"
        if c.finish_reason is None and not c.echoed and self.echo and not failed:
            pieces.append(self._echo(c, e))
        before = self._mark(c)
        if e.token is not None:
            if e.token != self.tok.eot_id:
                c.tokens.append(e.token)
            if c.logprobs is not None:
                # <|endoftext|> has a logprob entry too, as OpenAI's and vLLM's logprobs list it: lm-eval's
                # loglikelihood drops the one generated entry after an echoed prompt, whichever token it is
                self._add_logprob(c, e.token, e.logprob, e.top, e.rank, in_text=e.token != self.tok.eot_id)
        c.text += e.text
        pieces.append((e.text, before, self._mark(c)))
        if e.finish_reason is not None:  # eos and stop strings are both "stop"
            c.finish_reason = e.finish_reason if failed or e.finish_reason == "length" else "stop"
        return pieces

    def _echo(self, c: ChoiceState, e: Event) -> tuple[str, int, int]:
        """The prompt, once, before the first new token: its text, and with logprobs each token's entry (the first
        has none: nothing predicts it)."""
        c.echoed = True
        before = self._mark(c)
        text = self.tok.decode(c.prompt)
        if c.logprobs is not None:
            stats = e.prompt_stats
            self._add_logprob(c, c.prompt[0], None, None, None)
            logprobs = stats.logprob.tolist()  # whole tensors to lists once: a prompt may have 1,024 rows
            tops = ranks = [None] * len(logprobs)
            if stats.top_ids is not None:
                tops = [list(zip(i, v)) for i, v in zip(stats.top_ids.tolist(), stats.top_logprobs.tolist())]
                ranks = stats.rank.tolist()
            for t, lp, top, rank in zip(c.prompt[1:], logprobs, tops, ranks):
                self._add_logprob(c, t, lp, top, rank)
        else:
            c.offset += len(text)
        c.text += text
        return text, before, self._mark(c)

    @staticmethod
    def _mark(c: ChoiceState) -> int:
        return len(c.logprobs.tokens) if c.logprobs is not None else 0

    @staticmethod
    def _slice(c: ChoiceState, start: int, end: int) -> Logprobs | None:
        if c.logprobs is None:
            return None
        lp = c.logprobs
        return Logprobs(tokens=lp.tokens[start:end], token_logprobs=lp.token_logprobs[start:end],
                        top_logprobs=lp.top_logprobs[start:end], text_offset=lp.text_offset[start:end],
                        token_ranks=lp.token_ranks[start:end])

    def _check_failure(self, i: int) -> None:
        reason = self.choices[i].finish_reason
        if reason == "error" and (grammar := grammar_failure(self.errors[i])) is not None:  # the request's fault
            raise APIError(400, grammar, param=self.req.constraint_field())
        if reason == "error":
            raise APIError(500, f"the engine failed while running this request: {self.errors[i]}", type="server_error",
                           code="engine_error")
        if reason == "queue_timeout":
            raise APIError(503, "the request waited too long for a free slot; retry later", type="service_unavailable",
                           code="queue_timeout", headers={"Retry-After": "1"})
        if reason == "shutdown":
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutdown")

    async def whole(self) -> CompletionResponse | ChatCompletionResponse:
        """Wait for every choice and return the complete response."""
        try:
            while any(c.finish_reason is None for c in self.choices):
                i, e = await self.handle.events.get()
                self._apply(i, e)
                self._check_failure(i)
        finally:
            self.cancel()
        return self.response()

    def response(self) -> CompletionResponse | ChatCompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model_name, usage=self.usage(),
                                  choices=[Choice(index=c.index, text=c.text, logprobs=c.logprobs,
                                                  finish_reason=c.finish_reason) for c in self.choices])

    def opening(self) -> list[str]:
        """Events sent before the first token (none for completions)."""
        return []

    def piece(self, i: int, text: str, start: int, end: int, finish: str | None) -> str | None:
        """The stream chunk for a piece of choice i (None: nothing to send)."""
        c = self.choices[i]
        if not (text or end > start or finish is not None):
            return None
        return self._chunk([Choice(index=i, text=text, logprobs=self._slice(c, start, end), finish_reason=finish)])

    def _chunk(self, choices: list[Choice], usage: Usage | None = None) -> str:
        body = CompletionResponse(id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage)
        return f"data: {body.model_dump_json()}\n\n"

    def usage_chunk(self) -> str:
        return self._chunk([], self.usage())

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of text, finish_reason on each choice's last chunk, an optional
        usage chunk, then [DONE]. A failure mid-stream ends it with an error chunk."""
        try:
            for event in self.opening():
                yield event
            while any(c.finish_reason is None for c in self.choices):
                i, e = await self.handle.events.get()
                pieces = self._apply(i, e)
                c = self.choices[i]
                try:
                    self._check_failure(i)
                except APIError as err:
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
                for n, (text, start, end) in enumerate(pieces):
                    last = n == len(pieces) - 1
                    chunk = self.piece(i, text, start, end, c.finish_reason if last else None)
                    if chunk is not None:
                        yield chunk
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield self.usage_chunk()
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()  # a client that went away frees its slots within one step


class ChatRun(CompletionRun):
    """One /v1/chat/completions request: a completion of the rendered conversation, answered in the chat shape.
    The reply's leading whitespace is dropped (the template's "Assistant:" is followed by the model's own space)."""

    id_prefix = "chatcmpl-"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.began = [False] * len(self.choices)  # whether choice i has sent a character of its reply

    def response(self) -> ChatCompletionResponse:
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text.lstrip()),
                              logprobs=self._chat_logprobs(c, 0, len(c.entries)), finish_reason=c.finish_reason)
                   for c in self.choices]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model_name, choices=choices,
                                      usage=self.usage())

    def opening(self) -> list[str]:
        """OpenAI's first chunk of each choice: the role, with empty content."""
        return [self._chat_chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))])
                for c in self.choices]

    def piece(self, i: int, text: str, start: int, end: int, finish: str | None) -> str | None:
        c = self.choices[i]
        if not self.began[i]:
            text = text.lstrip()
            self.began[i] = bool(text)
        logprobs = self._chat_logprobs(c, start, end)
        if not (text or logprobs and logprobs.content or finish is not None):
            return None
        return self._chat_chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=text or None), logprobs=logprobs,
                                                 finish_reason=finish)])

    def usage_chunk(self) -> str:
        return self._chat_chunk([], self.usage())

    def _chat_chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        body = ChatCompletionChunk(id=self.id, created=self.created, model=self.model_name, choices=choices,
                                   usage=usage)
        return f"data: {body.model_dump_json()}\n\n"

    def _chat_logprobs(self, c: ChoiceState, start: int, end: int) -> ChatLogprobs | None:
        """The entries [start, end) of choice c in the chat shape: each token with its bytes and alternatives
        (<|endoftext|>, which ends the reply but is not in it, left out)."""
        if c.logprobs is None:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(**self._top(token, logprob), top_logprobs=[TopLogprob(**self._top(t, v)) for t, v in top or ()])
            for token, logprob, top in c.entries[start:end] if token != self.tok.eot_id])

    def _top(self, token: int, logprob: float | None) -> dict:
        return {"token": self.tok.token_text(token), "logprob": logprob, "bytes": list(self.tok.token_bytes(token))}

"""From a validated CompletionRequest to engine work and back: prompts to token ids, parameters to Requests, and
the engine's events to OpenAI completion responses (whole or as server-sent events)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from ..core.config import GPT2Config
from ..core.errors import GenerationError
from ..core.tokenizer import Tokenizer
from ..runtime.plan import Event
from ..runtime.requests import GenerationSettings, Request, build_requests, encode_prompts
from ..runtime.sampling import SamplingParams
from .async_engine import AsyncEngine, EngineDown, Handle, QueueFull
from .protocol import APIError, Choice, CompletionRequest, CompletionResponse, Logprobs, PromptTokensDetails, Usage

# the engine's names for the settings OpenAI's API calls otherwise
API_PARAM = {"max_new_tokens": "max_tokens", "num_samples": "n", "top_logprobs": "logprobs"}


def engine_requests(req: CompletionRequest, tokenizer: Tokenizer, config: GPT2Config,
                    adapter: int | None = None) -> list[Request]:
    """The request's sequences, through the engine's one request builder: n per prompt, choice j of a prompt drawing
    with seed + j (a random seed when none is given), each with the LoRA adapter its `model` named. Every bad value
    is a 400 that names its field."""
    try:
        prompts = encode_prompts(req.prompt, tokenizer)
        bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p, req.repetition_penalty,
                                  req.presence_penalty, req.frequency_penalty, bias)
        settings = GenerationSettings(max_new_tokens=16 if req.max_tokens is None else req.max_tokens,
                                      sampling=sampling, stop=req.stops, ignore_eos=req.ignore_eos, seed=req.seed,
                                      num_samples=req.n, top_logprobs=req.logprobs or 0,
                                      prompt_logprobs=req.echo and req.logprobs is not None)
        requests = build_requests(prompts, settings, config, tokenizer.eot_id).requests
        return requests if adapter is None else [replace(r, adapter=adapter) for r in requests]
    except GenerationError as e:
        raise APIError(400, str(e), param=API_PARAM.get(e.param, e.param)) from None


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



class CompletionRun:
    """One /v1/completions request in the engine: submit, then read its events as whole or streamed responses."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, req: CompletionRequest, model_name: str,
                 requests: list[Request]) -> None:
        """Submit the requests to the engine (429 when it holds too many, 503 once it has failed)."""
        self.engine, self.tok, self.req, self.model_name = engine, tokenizer, req, model_name
        self.requests = requests
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [ChoiceState(i, r.prompt, logprobs=Logprobs() if req.logprobs is not None else None)
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
            raise APIError(400, str(e), param=API_PARAM.get(e.param, e.param)) from None

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
        lp = c.logprobs
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob)
        lp.top_logprobs.append(None if top is None else {self.tok.token_text(t): v for t, v in top})
        lp.text_offset.append(c.offset)
        lp.token_ranks.append(rank)
        c.offset += len(text) if in_text else 0

    def _apply(self, i: int, e: Event) -> list[tuple[str, Logprobs | None]]:
        """Fold an event into choice i; returns the (text, logprobs) pieces it adds, for stream chunks: with echo,
        the prompt first as a piece of its own, then the new token."""
        c = self.choices[i]
        c.cached = max(c.cached, e.cached_tokens)
        pieces: list[tuple[str, Logprobs | None]] = []
        failed = e.finish_reason in ("shutdown", "queue_timeout", "cancelled", "error")
        if e.finish_reason == "error":
            self.errors[i] = e.error or "unknown error"
        if c.finish_reason is None and not c.echoed and self.req.echo and not failed:
            c.echoed = True
            before = self._mark(c)
            text = self.tok.decode(c.prompt)  # the prompt comes first, once
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
            pieces.append((text, self._since(c, before)))
        before = self._mark(c)
        if e.token is not None:
            if e.token != self.tok.eot_id:
                c.tokens.append(e.token)
            if c.logprobs is not None:
                # <|endoftext|> has a logprob entry too, as OpenAI's and vLLM's logprobs list it: lm-eval's
                # loglikelihood drops the one generated entry after an echoed prompt, whichever token it is
                self._add_logprob(c, e.token, e.logprob, e.top, e.rank, in_text=e.token != self.tok.eot_id)
        c.text += e.text
        pieces.append((e.text, self._since(c, before)))
        if e.finish_reason is not None:
            if failed:
                c.finish_reason = e.finish_reason
            else:
                c.finish_reason = "length" if e.finish_reason == "length" else "stop"  # eos and stop strings: "stop"
        return pieces

    @staticmethod
    def _mark(c: ChoiceState) -> int:
        return len(c.logprobs.tokens) if c.logprobs is not None else 0

    @staticmethod
    def _since(c: ChoiceState, before: int) -> Logprobs | None:
        if c.logprobs is None:
            return None
        lp = c.logprobs
        return Logprobs(tokens=lp.tokens[before:], token_logprobs=lp.token_logprobs[before:],
                        top_logprobs=lp.top_logprobs[before:], text_offset=lp.text_offset[before:],
                        token_ranks=lp.token_ranks[before:])

    def _check_failure(self, i: int) -> None:
        reason = self.choices[i].finish_reason
        if reason == "error":
            raise APIError(500, f"the engine failed while running this request: {self.errors[i]}", type="server_error",
                           code="engine_error")
        if reason == "queue_timeout":
            raise APIError(503, "the request waited too long for a free slot; retry later", type="service_unavailable",
                           code="queue_timeout", headers={"Retry-After": "1"})
        if reason == "shutdown":
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutdown")

    async def whole(self) -> CompletionResponse:
        """Wait for every choice and return the complete response."""
        try:
            while any(c.finish_reason is None for c in self.choices):
                i, e = await self.handle.events.get()
                self._apply(i, e)
                self._check_failure(i)
        finally:
            self.cancel()
        return CompletionResponse(id=self.id, created=self.created, model=self.model_name, usage=self.usage(),
                          choices=[Choice(index=c.index, text=c.text, logprobs=c.logprobs,
                                          finish_reason=c.finish_reason) for c in self.choices])

    def _chunk(self, choices: list[Choice], usage: Usage | None = None) -> str:
        body = CompletionResponse(id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage)
        return f"data: {body.model_dump_json()}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of text, finish_reason on each choice's last chunk, an optional
        usage chunk, then [DONE]. A failure mid-stream ends it with an error chunk."""
        try:
            while any(c.finish_reason is None for c in self.choices):
                i, e = await self.handle.events.get()
                pieces = self._apply(i, e)
                c = self.choices[i]
                try:
                    self._check_failure(i)
                except APIError as err:
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
                for n, (text, added) in enumerate(pieces):
                    last = n == len(pieces) - 1
                    if text or added and added.tokens or last and c.finish_reason is not None:
                        yield self._chunk([Choice(index=i, text=text, logprobs=added,
                                                  finish_reason=c.finish_reason if last else None)])
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield self._chunk([], self.usage())
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()  # a client that went away frees its slots within one step

"""From a validated CompletionRequest to engine work and back: prompts to token ids, parameters to Requests, and
the engine's events to OpenAI completion responses (whole or as server-sent events)."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..core.errors import GenerationError
from ..core.sampling import SamplingParams
from ..core.scheduler import Event, Request, check_request
from ..core.tokenizer import Tokenizer
from .engine import AsyncEngine, Handle, QueueFull
from .protocol import APIError, Choice, Completion, CompletionRequest, Logprobs, Usage


def prompts_of(req: CompletionRequest, tokenizer: Tokenizer, vocab: int) -> list[list[int]]:
    """The request's prompts as token ids: a string, a list of strings, a list of ids, or a list of id lists."""
    p = req.prompt
    if isinstance(p, str):
        texts = [p]
    elif all(isinstance(x, str) for x in p):
        texts = p
    else:
        lists = [p] if all(isinstance(x, int) for x in p) else p
        for ids in lists:
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return [list(ids) for ids in lists]
    # an empty string starts from <|endoftext|>, as the CLI does
    return [tokenizer.encode(t) or [tokenizer.eot_id] for t in texts]


def engine_requests(req: CompletionRequest, prompts: list[list[int]], config) -> list[Request]:
    """n Requests per prompt; choice j of a prompt draws with seed + j (a random seed when none is given)."""
    seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(7), "little")
    bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
    for token, _ in bias:
        if token >= config.vocab_size:
            raise APIError(400, f"logit_bias token id {token} is outside the vocabulary [0, {config.vocab_size})",
                           param="logit_bias")
    try:
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p, req.repetition_penalty,
                                  req.presence_penalty, req.frequency_penalty, bias)
    except GenerationError as e:
        raise APIError(400, str(e)) from None
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    out = []
    for prompt in prompts:
        for j in range(req.n):
            r = Request(prompt, max_tokens, sampling, req.stops, req.ignore_eos, (seed + j) % 2**63,
                        top_logprobs=req.logprobs or 0, prompt_logprobs=req.echo and req.logprobs is not None)
            try:
                check_request(r, config)
            except GenerationError as e:
                raise APIError(400, str(e), param="max_tokens" if max_tokens else "prompt") from None
            out.append(r)
    return out


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


class CompletionRun:
    """One /v1/completions request in the engine: submit, then read its events as whole or streamed responses."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, req: CompletionRequest, model_name: str,
                 requests: list[Request]) -> None:
        self.engine, self.tok, self.req, self.model_name = engine, tokenizer, req, model_name
        self.requests = requests
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [ChoiceState(i, r.prompt, logprobs=Logprobs() if req.logprobs is not None else None)
                        for i, r in enumerate(requests)]
        try:
            self.handle: Handle = engine.submit(requests)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None

    def cancel(self) -> None:
        if any(c.finish_reason is None for c in self.choices):
            self.engine.cancel(self.handle)

    def usage(self) -> Usage:
        prompt = sum(len(r.prompt) for r in self.requests[:: self.req.n])  # each prompt once, whatever n is
        completion = sum(len(c.tokens) for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def _token_text(self, token: int) -> str:
        return self.tok.token_bytes(token).decode("utf-8", errors="replace")

    def _add_logprob(self, c: ChoiceState, token: int, logprob: float | None, top: list[tuple[int, float]] | None,
                     rank: int | None) -> None:
        text = self._token_text(token)
        lp = c.logprobs
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob)
        lp.top_logprobs.append(None if top is None else {self._token_text(t): v for t, v in top})
        lp.text_offset.append(c.offset)
        lp.token_ranks.append(rank)
        c.offset += len(text)

    def _apply(self, i: int, e: Event) -> list[tuple[str, Logprobs | None]]:
        """Fold an event into choice i; returns the (text, logprobs) pieces it adds, for stream chunks: with echo,
        the prompt first as a piece of its own, then the new token."""
        c = self.choices[i]
        pieces: list[tuple[str, Logprobs | None]] = []
        failed = e.finish_reason in ("shutdown", "queue_timeout", "cancelled")
        if c.finish_reason is None and not c.echoed and self.req.echo and not failed:
            c.echoed = True
            before = self._mark(c)
            text = self.tok.decode(c.prompt)  # the prompt comes first, once
            if c.logprobs is not None:
                stats = e.prompt_stats
                self._add_logprob(c, c.prompt[0], None, None, None)
                for j, t in enumerate(c.prompt[1:]):
                    top = rank = None
                    if stats.top_ids is not None:
                        top = list(zip(stats.top_ids[j].tolist(), stats.top_logprobs[j].tolist()))
                        rank = int(stats.rank[j])
                    self._add_logprob(c, t, float(stats.logprob[j]), top, rank)
            else:
                c.offset += len(text)
            c.text += text
            pieces.append((text, self._since(c, before)))
        before = self._mark(c)
        if e.token is not None and e.token != self.tok.eot_id:
            c.tokens.append(e.token)
            if c.logprobs is not None:
                self._add_logprob(c, e.token, e.logprob, e.top, e.rank)
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

    @staticmethod
    def _check_failure(reason: str | None) -> None:
        if reason == "queue_timeout":
            raise APIError(503, "the request waited too long for a free slot; retry later", type="service_unavailable",
                           code="queue_timeout", headers={"Retry-After": "1"})
        if reason == "shutdown":
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutdown")

    async def whole(self) -> Completion:
        """Wait for every choice and return the complete response."""
        try:
            while any(c.finish_reason is None for c in self.choices):
                i, e = await self.handle.events.get()
                self._apply(i, e)
                self._check_failure(self.choices[i].finish_reason)
        finally:
            self.cancel()
        return Completion(id=self.id, created=self.created, model=self.model_name, usage=self.usage(),
                          choices=[Choice(index=c.index, text=c.text, logprobs=c.logprobs,
                                          finish_reason=c.finish_reason) for c in self.choices])

    def _chunk(self, choices: list[Choice], usage: Usage | None = None) -> str:
        body = Completion(id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage)
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
                    self._check_failure(c.finish_reason)
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

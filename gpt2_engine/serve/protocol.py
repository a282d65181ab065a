"""The OpenAI legacy completions API as request and response models, validated at the edge.

A request that passes these models is well-formed; whether it fits the model (context length, token ids) is
checked when it becomes engine work (serving.py). Every failure becomes an `APIError` in OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20
MAX_STOP = 4


class APIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions. OpenAI's defaults (max_tokens 16, temperature 1, top_p 1); extras top_k,
    repetition_penalty, ignore_eos as in vLLM. `model` may be left out: it is the served model, as vLLM and
    llama-server take it. The sampling values' ranges are the engine's one set (runtime/sampling.py's
    SamplingParams), checked when the request becomes engine work; these models check types and the API's limits."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # accepted for compatibility, rejected unless they ask for nothing different
    suffix: str | None = None
    best_of: int | None = None
    # extras
    top_k: int = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix is not None:
            raise APIError(400, "suffix is not supported by this server", param="suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by this server", param="best_of",
                           code="unsupported_parameter")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True  # vLLM's field, which lm-eval sends; GPT-2 adds no special tokens either way


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[int]
    model: str | None = None


class Logprobs(BaseModel):
    """The legacy completions logprobs: one entry per token of the choice's text (prompt tokens first with echo).
    `token_ranks` is this server's extension: each token's rank in the model's distribution (0 = the most likely;
    null for the first prompt token), which top_logprobs (at most 20) cannot give; the playground colours by it."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    token_ranks: list[int | None] = []


class Choice(BaseModel):
    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose keys and values the prefix cache held, as OpenAI reports them


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None

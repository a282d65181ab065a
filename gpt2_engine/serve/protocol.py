"""OpenAI's completions and chat completions APIs as request and response models, validated at the edge.

A request that passes these models is well-formed; whether it fits the model (context length, token ids) is
checked when it becomes engine work (serving.py). Every failure becomes an `APIError` in OpenAI's error shape.
Fields these models do not know are ignored, as OpenAI's and vLLM's servers ignore them (the app logs their names),
except those that ask for something this server cannot do (tools): those are a 400, never a silently different
answer. Structured output comes in OpenAI's shape (`response_format`: json_object, json_schema) or vLLM's
(`structured_outputs`: exactly one of choice, regex, json, grammar, json_object); JSON comes compact, as OpenAI's
structured outputs write it, unless the same object carries this server's extension "whitespace_flexible": true.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from ..core.errors import GenerationError
from ..runtime.constraints import Constraint

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
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


def unsupported(field: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server", param=field,
                    code="unsupported_parameter")


MAX_STEERING = 16  # edits one request may ask for


class SamplingFields(BaseModel):
    """The fields both APIs share. OpenAI's defaults (temperature 1, top_p 1); extras top_k, repetition_penalty,
    ignore_eos as in vLLM. `model` may be left out: it is the served model, as vLLM and llama-server take it. The
    sampling values' ranges are the engine's one set (runtime/sampling.py's SamplingParams), checked when the request
    becomes engine work; these models check types and the API's limits. `max_completion_tokens` is OpenAI's newer
    name for `max_tokens`: either may be given (both only when they agree)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # strict types: "yes" is not true, "1" not seed 1, true not 1 (OpenAI refuses them all); a JSON integer is a number
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=0)
    temperature: StrictFloat = 1.0
    top_p: StrictFloat = 1.0
    n: StrictInt = Field(default=1, ge=1, le=16)  # true is not 1, nor 2.0 two
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's: {"type": "text" | "json_object" | "json_schema", ...}
    # extras
    top_k: StrictInt = 0
    repetition_penalty: StrictFloat = 1.0
    ignore_eos: StrictBool = False
    structured_outputs: dict[str, Any] | None = None  # vLLM's: one of choice, regex, json, grammar, json_object
    # the engine's: edits while generating, naming the server's --sae / --steering-vector entries (interp/steering.py)
    steering: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_STEERING)

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
            if not (key.isascii() and key.isdigit()):  # str.isdigit() is true of "²" and "١٢" too
                raise ValueError(f"logit_bias keys must be token ids (decimal digits 0-9), got {key!r}")
        return v

    @model_validator(mode="after")
    def _one_max_tokens(self) -> SamplingFields:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise APIError(400, f"max_tokens ({a}) and max_completion_tokens ({b}) disagree; give one of them",
                           param="max_completion_tokens")
        return self

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        self.constraint()  # a malformed one is a 400 now, naming its field
        return self

    def constraint_field(self) -> str:
        return "structured_outputs" if self.structured_outputs else "response_format"

    def constraint(self) -> Constraint | None:
        """The structured output asked for, in either shape (not both), or None for free text. JSON is compact unless
        the shape carries "whitespace_flexible": true (llguidance's name; vLLM's is disable_any_whitespace, with the
        opposite default): then any whitespace may come between JSON tokens."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.get("type", "text") != "text" and so:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        try:
            flexible = (so or fmt or {}).get("whitespace_flexible", False)
            if not isinstance(flexible, bool):
                raise GenerationError(f"{self.constraint_field()}.whitespace_flexible must be true or false, got "
                                      f"{flexible!r}", param="constraint")
            return structured_outputs(so, flexible) if so else response_format(fmt, flexible)
        except GenerationError as e:
            raise APIError(400, str(e), param=self.constraint_field()) from None

    def new_tokens(self, default: int) -> int:
        """The most tokens to generate: max_tokens or max_completion_tokens, else `default`."""
        given = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        return default if given is None else given

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def ignored(self) -> list[str]:
        """The unknown fields this request carried, which the server ignores."""
        return sorted((self.model_extra or {}).keys())


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a prompt (text, token ids, or a list of either) continued; max_tokens 16 unless given."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # true is not token 1
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    # accepted for compatibility, rejected unless they ask for nothing different
    suffix: str | None = None
    best_of: StrictInt | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix is not None:
            raise unsupported("suffix", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "best_of other than n")
        return self


class ChatMessage(BaseModel):
    """One message of a conversation. `content` is text, or a list of text parts ({"type": "text", "text": ...})."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        if v == []:
            raise ValueError("content: expected a string or at least one text part, got an empty list")
        for part in v if isinstance(v, list) else ():
            if part.get("type") != "text":  # (an empty list is refused below, as OpenAI refuses it)
                raise ValueError(f"only text parts ({{'type': 'text', 'text': ...}}) are supported, got "
                                 f"{str(part.get('type'))[:40]!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"a text part's \"text\" must be a string, got {type(part.get('text')).__name__}")
        return v

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: the messages rendered by the server's chat template, then continued as a completion;
    up to the context unless max_completion_tokens (or max_tokens) says fewer. `logprobs` is a yes/no here, with
    `top_logprobs` alternatives per token."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # accepted for compatibility, rejected when they ask for what this server cannot do
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.tools or self.functions:
            raise unsupported("tools" if self.tools else "functions", "tool calling")
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            raise unsupported("tool_choice" if self.tool_choice not in (None, "none") else "function_call",
                              "tool calling")
        if self.modalities is not None and list(self.modalities) != ["text"]:
            raise unsupported("modalities", "output other than text")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self


class TokenizeRequest(BaseModel):
    """POST /tokenize: a text, or (as vLLM's) a conversation as the chat template renders it for /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    model: str | None = None
    add_special_tokens: StrictBool = True  # vLLM's field, which lm-eval sends; GPT-2 adds no special tokens either way

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt (a text) or messages (a conversation), not both or neither",
                           param="prompt")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    tokens: list[StrictInt]  # true is not token 1, nor 2.0 token 2
    model: str | None = None


class Logprobs(BaseModel):
    """The legacy completions logprobs: one entry per token of the choice's text (prompt tokens first with echo).
    `token_ranks` is this server's extension: each token's rank in the model's distribution (1 = the most likely, as
    vLLM's logprobs, gpt2 score and gpt2 inspect count; null for the first prompt token), which top_logprobs (at most 20) cannot give; the playground colours by it."""

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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    """The chat API's logprobs: one entry per token of the reply, with its bytes and its top alternatives."""

    content: list[TokenLogprob] = []


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# structured_outputs' kinds (vLLM's) and the Constraint each makes of its value and the whitespace option
STRUCTURED_OUTPUTS: dict[str, Callable[[Any, bool], Constraint]] = {
    "choice": lambda value, _: Constraint.choice(value),
    "regex": lambda value, _: Constraint.regex(string_field("regex", value)),
    "json": lambda value, flexible: Constraint.json_schema(value, whitespace_flexible=flexible),
    "grammar": lambda value, _: Constraint.grammar(string_field("grammar", value)),
    "json_object": lambda _, flexible: Constraint.json_object(whitespace_flexible=flexible),
}


def string_field(kind: str, value: Any) -> str:
    if not isinstance(value, str):
        raise GenerationError(f"structured_outputs.{kind} must be a string", param="constraint")
    return value


def structured_outputs(so: dict[str, Any], flexible: bool) -> Constraint:
    """vLLM's structured_outputs: exactly one of choice, regex, json, grammar, json_object (a flag: false or null asks
    for nothing, as a missing field; any other value of the others is theirs to check)."""
    flag = so.get("json_object")
    if flag is not None and not isinstance(flag, bool):  # "yes" or 1 would be true
        raise GenerationError(f"structured_outputs.json_object must be true or false, got {json.dumps(flag)[:60]}",
                              param="constraint")
    given = [k for k in STRUCTURED_OUTPUTS if so.get(k) is not None and not (k == "json_object" and flag is False)]
    if len(given) != 1:
        raise GenerationError("structured_outputs must give exactly one of choice, regex, json, grammar, "
                              f"json_object; got {', '.join(given) or 'none'}", param="constraint")
    kind = given[0]
    if flexible and kind not in ("json", "json_object"):
        raise GenerationError(f"structured_outputs.whitespace_flexible applies to json and json_object, not {kind}",
                              param="constraint")
    return STRUCTURED_OUTPUTS[kind](so[kind], flexible)


def response_format(fmt: dict[str, Any] | None, flexible: bool) -> Constraint | None:
    """OpenAI's response_format: text (None), json_object or json_schema."""
    if fmt is None or fmt.get("type", "text") == "text":
        return None
    if fmt["type"] == "json_object":
        return Constraint.json_object(whitespace_flexible=flexible)
    if fmt["type"] == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise GenerationError("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                  "\"schema\": {...}}}", param="constraint")
        return Constraint.json_schema(spec["schema"], whitespace_flexible=flexible)
    raise GenerationError(f"response_format type must be text, json_object or json_schema, got {fmt['type']!r}",
                          param="constraint")

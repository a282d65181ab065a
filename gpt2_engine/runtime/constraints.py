"""Structured output: a grammar the generated text must match, enforced token by token, on llguidance.

llguidance (the Rust library behind llama.cpp's and vLLM's guidance backends) compiles a JSON schema, a regex, a list
of choices or a Lark or GBNF grammar against GPT-2's tokenizer, read from the very tiktoken encoding the engine uses.
At each step it computes which tokens keep the text matchable, as a bitmask; the scheduler sets every other logit to
-inf before the penalties, the temperature and the filters, so that sampling stays a distribution over the allowed
tokens, and <|endoftext|> is allowed only where the grammar may end. llguidance bounds the work of a grammar and of
each step by its own limits ("fuel"), so a pathological schema is an error, never a hang.

Why llguidance rather than xgrammar: it reads a tiktoken encoding as it is and depends on nothing (xgrammar requires
transformers and triton, which the engine's own paths never import); the measured compile and mask times of both
are in docs/benchmarks.md.

`Constraint` is the user's request (data); `Grammars` compiles it once per text (cached) into a `Compiled` grammar;
each sequence then gets its own `Guide` (a copy of the compiled matcher) when the scheduler admits it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.errors import GenerationError
from ..core.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
CACHED_GRAMMARS = 64  # compiled grammars kept, least recently used first out


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match. kind: 'json_schema' (spec: the schema as JSON text), 'json_object' (any
    JSON object), 'regex' (the whole text matches it), 'choice' (spec: a JSON list of the allowed texts) or 'grammar'
    (a Lark grammar in llguidance's dialect, or a GBNF grammar in llama.cpp's)."""

    kind: str
    spec: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GenerationError(f"the JSON schema is not valid JSON ({e})", param="constraint") from None
        if not isinstance(schema, (dict, bool)):
            raise GenerationError(f"a JSON schema must be an object, got {type(schema).__name__}", param="constraint")
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Constraint:
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise GenerationError(f"choice must be a non-empty list of non-empty strings, got {choices!r}",
                                  param="constraint")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        return cls("grammar", text)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GenerationError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}",
                                  param="constraint")

    def definition(self) -> str:
        """The grammar in llguidance's form (not yet checked)."""
        import llguidance

        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
            if self.kind == "choice":
                # each choice a quoted Lark string: any text, nothing of it read as grammar
                lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(self.spec))
                return llguidance.LLMatcher.grammar_from_lark(lark)
            kind = {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar"}[self.kind]
            return llguidance.grammar_from(kind, self.spec)
        except (ValueError, TypeError) as e:
            raise GenerationError(f"{self.describe()}: {one_line(e)}", param="constraint") from None

    def describe(self) -> str:
        return {"json_schema": "the JSON schema", "json_object": "JSON", "regex": f"the regex {self.spec!r}",
                "choice": "the choices", "grammar": "the grammar"}[self.kind]


class Compiled:
    """A checked grammar and a pristine matcher for it, which each sequence's Guide copies."""

    def __init__(self, constraint: Constraint, matcher: Any, vocab_size: int) -> None:
        self.constraint, self.matcher, self.vocab_size = constraint, matcher, vocab_size

    def guide(self) -> Guide:
        return Guide(self.matcher.deep_copy(), self.vocab_size)


class Grammars:
    """Compiles constraints for one tokenizer: its llguidance tokenizer is built once (about a second), and the last
    CACHED_GRAMMARS compiled grammars are kept by their text."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltokenizer: Any = None
        self._cache: OrderedDict[Constraint, Compiled] = OrderedDict()

    def compile(self, constraint: Constraint) -> Compiled:
        """The compiled grammar; GenerationError (param 'constraint') naming what is wrong with it."""
        found = self._cache.get(constraint)
        if found is not None:
            self._cache.move_to_end(constraint)
            return found
        import llguidance

        if self._lltokenizer is None:
            from llguidance.tiktoken import lltokenizer_from_encoding

            self._lltokenizer = lltokenizer_from_encoding(self.tokenizer.encoding, n_vocab=self.tokenizer.n_vocab,
                                                          eos_token=self.tokenizer.eot_id)
        definition = constraint.definition()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition, self._lltokenizer)
        if failed:
            raise GenerationError(f"{constraint.describe()}: {one_line(messages[0])}", param="constraint")
        matcher = llguidance.LLMatcher(self._lltokenizer, definition, log_level=0)
        if matcher.is_error():
            raise GenerationError(f"{constraint.describe()}: {one_line(matcher.get_error())}", param="constraint")
        compiled = Compiled(constraint, matcher, self.vocab_size)
        self._cache[constraint] = compiled
        if len(self._cache) > CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return compiled


class Guide:
    """One sequence's place in its grammar: which tokens may come next, and the tokens it took."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # llguidance's mask: bit t of word t // 32

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] -> a copy with -inf for every token the grammar does not allow next."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        if self.matcher.is_error():
            raise GenerationError(f"the grammar failed: {one_line(self.matcher.get_error())}", param="constraint")
        allowed = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        if len(allowed) < logits.shape[-1]:  # a padded vocabulary: the padding rows are never allowed
            allowed = np.pad(allowed, (0, logits.shape[-1] - len(allowed)))
        return logits.masked_fill(torch.from_numpy(allowed == 0), -torch.inf)

    def accept(self, token: int) -> None:
        """Advance past `token`, which the mask allowed."""
        if not self.matcher.consume_token(token):
            raise GenerationError(f"the grammar refused token {token}: {one_line(self.matcher.get_error())}",
                                  param="constraint")

    @property
    def finished(self) -> bool:
        """Whether the grammar allows nothing more (not even more text: only the end)."""
        return self.matcher.is_stopped()


def one_line(e: BaseException | str) -> str:
    text = " ".join(str(e).split())
    return text[:300] or type(e).__name__

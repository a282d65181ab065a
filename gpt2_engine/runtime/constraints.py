"""Structured output: a grammar the generated text must match, enforced token by token, on llguidance.

llguidance (the Rust library behind llama.cpp's and vLLM's guidance backends) compiles a JSON schema, a regex, a list
of choices or a Lark or GBNF grammar against GPT-2's tokenizer, read from the very tiktoken encoding the engine uses.
At each step it computes which tokens keep the text matchable, as a bitmask; the scheduler sets every other logit to
-inf before the penalties, the temperature and the filters, so that sampling stays a distribution over the allowed
tokens, and <|endoftext|> is allowed only where the grammar may end. JSON comes compact (no whitespace outside
strings, as OpenAI's structured outputs write it) unless the constraint asks for llguidance's flexible whitespace: a
weak model at temperature 1 otherwise can spend all its tokens on spaces and newlines.

Hostile grammars, and what bounds them (GrammarLimits): llguidance's compiler recurses once per level of a grammar
and overflows its stack (a SIGSEGV) on a chain of a few thousand rules; counted repetitions spend its lexer fuel for
minutes at its default; a long literal costs it about the square of its length at every token, whatever its fuel;
and nothing in it can be interrupted. So llguidance never runs in this process. A grammar's text is first checked
here (bytes, longest literal, the literal llguidance would join from its fixed strings: grammar_text.py, rules,
$refs, nesting): what is refused there costs nothing. It is then compiled, with its first mask and 16 tokens taken on
a copy, in the compile process (runtime/grammar_worker.py) within a time limit: a crash or a runaway there costs a
400, never the server, and a grammar whose tokens cost more CPU than `token_seconds` is refused. Each sequence's
matcher then lives in the guide process, where each token is taken and the next mask computed, one round trip per
token that the engine thread waits for at most `step_seconds`: past it, or if it dies, that process is killed, the
grammar at fault is refused, and the sequences beside it are carried over to the next process (a spare, ready after
the first kill), which takes their tokens again. That bound holds whatever the text check missed; a sequence whose
steps average over `token_seconds` is ended too. Neither needs a thread beside torch's (one slowed decoding:
docs/benchmarks.md): the engine thread sleeps while the guide process works.

Why llguidance rather than xgrammar: it reads a tiktoken encoding as it is and depends on nothing (xgrammar requires
transformers and triton, which the engine's own paths never import); the measured compile and mask times of both
are in docs/benchmarks.md.

`Constraint` is the user's request (data); `Grammars` compiles it once per text (cached) into a `Compiled` grammar;
each sequence then gets its own `Guide` (a copy of the compiled matcher) when the scheduler admits it.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import pickle
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.errors import GenerationError
from ..core.scalars import as_int, as_real
from ..core.tokenizer import Tokenizer
from . import grammar_worker
from .grammar_text import longest_literal, regex_length
from .grammar_worker import KINDS

CACHED_GRAMMARS = 64  # compiled grammars (and refused ones) kept, least recently used first out
WORKER_STACK = 16 << 20  # the compile process's thread: llguidance needs ~3.4 KB a level, so ~4,800 levels
GUIDE_STACK = 4 * WORKER_STACK  # the guide process's thread: what passed the compile process cannot overflow there
ALLOWANCE_TOKENS = 16  # a sequence's grammar work is held to token_seconds a token on average past this many tokens' worth
WORKER_START_SECONDS = 60.0  # for the compile process to start and build its tokenizer (~1 s on an idle machine)
RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?:::=|:)", re.MULTILINE)  # a Lark or GBNF rule's head
LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)*/')  # a grammar's quoted string or /regex/
# the compile process is started with the standard library's runner on its file, with this process's import path:
# importing it as gpt2_engine.runtime.grammar_worker would import the whole package (torch) for nothing
WORKER_BOOT = "import runpy, sys; sys.path[:0] = sys.argv[2:]; runpy.run_path(sys.argv[1], run_name='__main__')"


class GrammarError(GenerationError):
    """A grammar that cannot be compiled, or that goes over one of the GrammarLimits (param 'constraint')."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="constraint")


MAX_CHOICES = 2000  # alternatives of one choice constraint


def json_number(value: object) -> bool | int | float:
    """A numpy or torch scalar inside a schema as the JSON value it is (json.dumps' `default`); TypeError else."""
    if isinstance(value, np.bool_):
        return bool(value)
    number = as_int(value)
    number = as_real(value) if number is None else number
    if number is None:
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
    return number


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match. kind: 'json_schema' (spec: the schema as JSON text), 'json_object' (any
    JSON object), 'regex' (the whole text matches it), 'choice' (spec: a JSON list of the allowed texts) or 'grammar'
    (a Lark grammar in llguidance's dialect, or a GBNF grammar in llama.cpp's). JSON is compact unless
    whitespace_flexible (llguidance's name): then any whitespace may come between its tokens."""

    kind: str
    spec: str = ""
    whitespace_flexible: bool = False

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, *, whitespace_flexible: bool = False) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise GenerationError("the JSON schema nests too deeply to read", param="constraint") from None
            except ValueError as e:
                raise GenerationError(f"the JSON schema is not valid JSON ({e})", param="constraint") from None
        if schema is True:  # JSON Schema's boolean schema: true allows any JSON, as {} does
            schema = {}
        if not isinstance(schema, dict):  # false (which no text matches) too
            shown = json.dumps(schema) if schema is None or isinstance(schema, (bool, int, float)) else \
                type(schema).__name__
            raise GenerationError(f"a JSON schema must be an object, or its JSON text (true is taken as {{}}: any "
                                  f"JSON), got {shown}", param="constraint")
        try:
            text = json.dumps(schema, sort_keys=True, default=json_number, allow_nan=False)
        except RecursionError:
            raise GenerationError("the JSON schema nests too deeply to read", param="constraint") from None
        except (TypeError, ValueError) as e:  # a set, bytes or a non-string key inside it; NaN or Infinity
            if "Out of range float" in str(e):
                raise GenerationError("the JSON schema holds NaN or Infinity, which are not JSON numbers (llguidance "
                                      "would read them as null); expected finite numbers", param="constraint") from None
            raise GenerationError(f"the JSON schema must hold only JSON values (dicts with string keys, lists, strings, "
                                  f"numbers, booleans, None): {e}", param="constraint") from None
        return cls("json_schema", text, whitespace_flexible)

    @classmethod
    def json_object(cls, *, whitespace_flexible: bool = False) -> Constraint:
        return cls("json_object", "", whitespace_flexible)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Iterable[str]) -> Constraint:
        if isinstance(choices, (str, bytes)) or not isinstance(choices, Iterable):
            raise GenerationError(f"choice must be a non-empty list of non-empty strings, got {type(choices).__name__}",
                                  param="constraint")
        choices = list(itertools.islice(choices, MAX_CHOICES + 1))  # any iterable of strings, read no further
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GenerationError(f"choice must be a non-empty list of non-empty strings, got {choices!r:.200}",
                                  param="constraint")
        if len(choices) > MAX_CHOICES:  # the grammar library's parser refuses a row this long, in its own words
            raise GenerationError(f"choice: over {MAX_CHOICES:,} choices; expected at most {MAX_CHOICES:,}",
                                  param="constraint")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        return cls("grammar", text)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GenerationError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}",
                                  param="constraint")
        if not isinstance(self.spec, str):
            raise GenerationError(f"the constraint's spec must be a string, got {type(self.spec).__name__}",
                                  param="constraint")
        if not isinstance(self.whitespace_flexible, bool):
            raise GenerationError(f"whitespace_flexible must be True or False, got {self.whitespace_flexible!r}",
                                  param="constraint")
        if self.whitespace_flexible and self.kind not in ("json_schema", "json_object"):
            raise GenerationError(f"whitespace_flexible applies to JSON (json_schema, json_object), not {self.kind}",
                                  param="constraint")

    def describe(self) -> str:
        regex = self.spec if len(self.spec) <= 60 else self.spec[:57] + "..."
        return {"json_schema": "the JSON schema", "json_object": "JSON", "regex": f"the regex {regex!r}",
                "choice": "the list of choices", "grammar": "the grammar"}[self.kind]


@dataclass(frozen=True)
class GrammarLimits:
    """What one grammar may cost. The sizes are checked before llguidance sees the grammar; the times bound the
    compile (in its own process, killed past it) and each token's work (in the guide process, killed past it)."""

    max_bytes: int = 100_000  # the schema, regex, choices or grammar text, in UTF-8 bytes
    max_literal: int = 1_000  # characters of one string (a JSON schema's, a choice, a grammar's): ~0.4 ms a token
    max_spelled: int = 4_000  # UTF-8 bytes of a literal llguidance joins from fixed strings (a pattern's too): ~10 ms
    max_regex: int = 10_000  # characters of a regex (what its repetitions cost is measured: token_seconds)
    max_rules: int = 1_000  # a grammar's rules, a schema's $refs: each may add a level to the compiler's recursion
    max_depth: int = 64  # a JSON schema's nesting (llguidance's JSON reader stops at 128)
    compile_seconds: float = 5.0  # one compile, first mask and probe included, in wall time
    build_seconds: float = 0.1  # the CPU of building a grammar and its first mask (a schema takes about a millisecond,
    # 2,000 choices 11 ms): what a sequence new to the guide process waits for, so held near a step's budget
    step_seconds: float = 0.1  # one token's advance and mask, in wall time: the longest the engine thread waits
    # (a grammar within the other limits takes at most ~10 ms a step; a process that did not have the CPU for half
    # of the wait is not the grammar's doing: GuideLost)
    token_seconds: float = 0.001  # a token's mask and advance in CPU time (tens of microseconds for a schema): the
    # median of the compile's probe, and each sequence's average past ALLOWANCE_TOKENS: what the sequences beside wait
    lexer_fuel: int = 50_000  # llguidance's initial_lexer_fuel (its default is 1,000,000)
    step_fuel: int = 20_000  # llguidance's step_lexer_fuel: one token's lexer work (its default is 200,000)
    row_items: int = 2_048  # llguidance's max_items_in_row (2,000 by default): MAX_CHOICES choices sharing a prefix
    # hold one item more than that once the prefix is taken

    def check(self, constraint: Constraint) -> None:
        """GrammarError naming the limit a constraint's text goes over, before any compile. A literal costs
        llguidance about the square of its length at each token (whatever its fuel: 0.4 ms at 1,000 characters,
        27 ms at 10,000, 9 s at 100,000), hence the bound on literals as well as on the whole; a regex's repetitions
        (`e{9990}`) are measured instead, by the compile's probe."""
        what, spec = constraint.describe(), constraint.spec
        if constraint.kind == "grammar":
            rules = len(RULE.findall(spec))
            if rules > self.max_rules:
                raise GrammarError(f"{what} has {rules:,} rules; at most {self.max_rules:,}")
        size = len(spec.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise GrammarError(f"{what} is {size:,} bytes; at most {self.max_bytes:,}")
        longest = 0
        if constraint.kind == "json_schema":
            try:
                refs, depth, longest, spelled = schema_shape(json.loads(spec))
            except (ValueError, RecursionError):
                raise GrammarError(f"{what} is not valid JSON, its patterns nest too deeply, or it nests too deeply "
                                   "to read") from None
            if spelled > self.max_spelled:  # llguidance's fuel ends it, but after ~0.3 s of the engine's time
                raise GrammarError(f"{what} has a pattern with {spelled:,} bytes of fixed text in a row "
                                   f"(llguidance makes it one literal, which costs the square of its length at every "
                                   f"token); at most {self.max_spelled:,}")
            if depth > self.max_depth:
                raise GrammarError(f"{what} nests {depth:,} levels deep; at most {self.max_depth:,}")
            if refs > self.max_rules:
                raise GrammarError(f"{what} has {refs:,} $refs; at most {self.max_rules:,}")
        elif constraint.kind == "choice":
            longest = max(map(len, json.loads(spec)))  # a JSON list of strings, as Constraint.choice writes it
        elif constraint.kind == "grammar":
            longest = self.check_grammar(what, spec)
        elif constraint.kind == "regex" and len(spec) > self.max_regex:
            raise GrammarError(f"{what} is {len(spec):,} characters; at most {self.max_regex:,}")
        if longest > self.max_literal:
            raise GrammarError(f"{what} has a literal of {longest:,} characters; at most {self.max_literal:,}")


    def check_grammar(self, what: str, spec: str) -> int:
        """GrammarError where a grammar makes llguidance build a literal longer than max_spelled (fixed strings it joins
        into one lexeme, whose cost no probe of the cheapest branch sees: grammar_text.py); else its longest
        literal."""
        longest = max((len(m) - 2 for m in LITERAL.findall(spec)), default=0)
        if longest > self.max_literal:
            return longest  # check() names the one literal
        try:
            spelled = longest_literal(spec)
        except ValueError as e:
            raise GrammarError(f"{what}: {e}") from None
        if spelled > self.max_spelled:
            raise GrammarError(f"{what} makes a literal of {spelled:,} bytes (fixed strings side by side or "
                               f"repeated, which llguidance joins into one lexeme that costs the square of its length "
                               f"at every token); at most {self.max_spelled:,}")
        return longest


# a schema's keys whose values are never generated (not literals), and those whose values are schemas by name
ANNOTATIONS = frozenset({"description", "title", "$comment", "examples", "default", "$schema", "$id"})
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def schema_shape(schema: Any) -> tuple[int, int, int, int]:
    """A parsed JSON schema's $ref count, nesting depth (objects and arrays), longest string that can be generated
    (property names, const and enum values; not a description, title, comment or example) and longest run of fixed
    text in its patterns (grammar_text.regex_length: a pattern is a regex, not a literal), walked without recursion.
    A dict is a schema, or (under NAMED_SCHEMAS) a map from names to schemas; ValueError for a pattern nested too
    deeply to read."""
    refs = deepest = longest = spelled = 0
    todo = [(schema, 1, False)]
    while todo:
        node, depth, named = todo.pop()
        if isinstance(node, dict):
            refs += "$ref" in node and not named
            longest = max([longest, *map(len, node)])
            if not named:
                spelled = max(spelled, patterns_run(node))
            todo.extend((v, depth + 1, not named and k in NAMED_SCHEMAS) for k, v in node.items()
                        if named or (k not in ANNOTATIONS and not (k == "pattern" and isinstance(v, str))))
        elif isinstance(node, list):
            todo.extend((v, depth + 1, False) for v in node)
        elif isinstance(node, str):
            longest = max(longest, len(node))
            continue
        else:
            continue
        deepest = max(deepest, depth)
    return refs, deepest, longest, spelled


def patterns_run(schema: dict) -> int:
    """The longest run of fixed text in a schema's own regexes: its pattern and its patternProperties' names."""
    names = schema.get("patternProperties")
    patterns = [schema.get("pattern"), *(names if isinstance(names, dict) else ())]
    return max((regex_length(p) for p in patterns if isinstance(p, str)), default=0)


class WorkerProcess:
    """A grammar_worker process in one `role`, started on first use and killed (stop) when it runs past a limit or
    its parent is done with it; frames both ways are an 8-byte big-endian length and a payload."""

    role = ""
    stack_bytes = WORKER_STACK

    def __init__(self, tokenizer: Tokenizer, limits: GrammarLimits) -> None:
        self.tokenizer, self.limits = tokenizer, limits
        self.process: subprocess.Popen | None = None
        self.ready = False  # its "ready" frame was read
        self.started_cpu = 0.0  # the CPU seconds it had used when it was ready (building llguidance's tokenizer)

    def start(self, wait: bool = True) -> None:
        """Start the process and send its setup; with `wait`, wait for it to be ready (about a second: it builds
        llguidance's tokenizer), else the next `wait_ready` does."""
        self.process, self.ready = self.spawn(), False
        if wait:
            self.wait_ready()

    def spawn(self) -> subprocess.Popen:
        """A new process, its setup sent."""
        path = [p for p in sys.path if p]  # "" (the current directory) is the same directory for the child
        process = subprocess.Popen([sys.executable, "-I", "-c", WORKER_BOOT, grammar_worker.__file__, *path],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
        setup = {"role": self.role, "encoding": self.tokenizer.encoding, "n_vocab": self.tokenizer.n_vocab,
                 "eos": self.tokenizer.eot_id, "lexer_fuel": self.limits.lexer_fuel, "step_fuel": self.limits.step_fuel,
                 "row_items": self.limits.row_items, "stack_bytes": self.stack_bytes,
                 "kept_built": 2 * CACHED_GRAMMARS}  # the guide role's: what this process still holds compiled
        try:
            send_frame(process, pickle.dumps(setup))
        except BrokenPipeError:
            process.kill()
            raise RuntimeError(f"the grammar {self.role} process did not start ({ended_by(process.wait())})") \
                from None
        return process

    def wait_ready(self) -> None:
        if self.process is None:
            self.start(wait=False)
        if not self.ready:
            try:
                self.started_cpu = json.loads(self.receive(WORKER_START_SECONDS))["cpu"]
            except (EOFError, TimeoutError):
                code = self.stop()
                raise RuntimeError(f"the grammar {self.role} process did not start ({ended_by(code)})") from None
            self.ready = True

    def stop(self) -> int:
        """Kill the process (if it still runs); its exit status."""
        process, self.process = self.process, None
        return 0 if process is None else killed(process)[0]

    def send(self, payload: bytes) -> None:
        send_frame(self.process, payload)

    def receive(self, seconds: float) -> bytes:
        """The next frame's payload; TimeoutError after `seconds`, EOFError if the process ended."""
        deadline = time.monotonic() + seconds
        head = self._read(8, deadline)
        return self._read(struct.unpack(">Q", head)[0], deadline)

    def _read(self, size: int, deadline: float) -> bytes:
        fd, data = self.process.stdout.fileno(), bytearray()
        while len(data) < size:
            if not select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]:
                raise TimeoutError
            chunk = os.read(fd, size - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)


def send_frame(process: subprocess.Popen, payload: bytes) -> None:
    """Write one frame (an 8-byte big-endian length, then the payload) to a worker process's stdin."""
    data = memoryview(struct.pack(">Q", len(payload)) + payload)
    while data:
        data = data[os.write(process.stdin.fileno(), data):]


def ended_by(code: int) -> str:
    """A process's exit status in words."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def killed(process: subprocess.Popen) -> tuple[int, float]:
    """Kill a worker process (if it still runs) and close its pipes; its exit status and the CPU seconds it used in
    all (reaped here with wait4, which reports them)."""
    cpu = 0.0
    if process.returncode is None:  # not reaped: a zombie if it has ended (Popen.kill would reap it first)
        os.kill(process.pid, signal.SIGKILL)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode, cpu = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
    process.stdin.close()
    process.stdout.close()
    return process.returncode, cpu


class CompileWorker(WorkerProcess):
    """llguidance's compiler run apart and waited for at most compile_seconds (its probe included). Killed when a
    grammar runs past the limit, and started again for the next."""

    role = "compile"

    def compile(self, constraint: Constraint) -> tuple[str, str, float, float]:
        """(llguidance's definition of the constraint, "" or why it cannot be compiled, its probe's median CPU
        seconds a token, the CPU seconds of its build); GrammarError when it runs past the time limit, crashes the
        compiler or takes longer than limits.build_seconds to build."""
        if self.process is None:
            self.start()
        what = constraint.describe()
        try:
            self.send(json.dumps({"kind": constraint.kind, "spec": constraint.spec,
                                  "whitespace_flexible": constraint.whitespace_flexible,
                                  "step_seconds": self.limits.step_seconds,
                                  "token_seconds": self.limits.token_seconds,
                                  "allowance_tokens": ALLOWANCE_TOKENS}).encode())
            deadline = time.monotonic() + self.limits.compile_seconds
            build = 4 * self.limits.build_seconds  # in wall time: a machine busy with other work slows it
            try:
                json.loads(self.receive(min(build, self.limits.compile_seconds)))
            except TimeoutError:
                self.stop()
                raise GrammarError(f"{what} took over {build:g} s to build (llguidance's compile and first mask); at "
                                   f"most {self.limits.build_seconds:g} s of CPU") from None
            answer = json.loads(self.receive(max(deadline - time.monotonic(), 0.0)))
        except (BrokenPipeError, EOFError):  # it ended on its own: a crash
            raise GrammarError(f"{what} crashed llguidance's compiler ({ended_by(self.stop())}); simplify it") from None
        except TimeoutError:
            self.stop()
            raise GrammarError(f"{what} took over {self.limits.compile_seconds:g} s to compile; at most "
                               f"{self.limits.compile_seconds:g} s") from None
        if not answer["error"] and answer["build"] > self.limits.build_seconds:  # what failed says why, first
            raise GrammarError(f"{what} takes {answer['build']:.2f} s of CPU to build (llguidance's compile and first "
                               f"mask, done again for each process that follows it); at most "
                               f"{self.limits.build_seconds:g} s")
        return answer["grammar"], answer["error"], answer["cost"], answer["build"]


CRASHES = (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT, -signal.SIGILL, -signal.SIGFPE)  # llguidance's own end


class GuideLost(Exception):
    """The guide process ran past a deadline and was killed, or ended. `blamed`: the request in flight caused it (it
    kept the CPU busy for at least half of the wait, or the process crashed); else it was stopped, starved of CPU or
    killed from outside. The message says what happened, to follow "the grammar " or "the guide process "."""

    def __init__(self, message: str, blamed: bool) -> None:
        super().__init__(message)
        self.blamed = blamed


class GuideWorker(WorkerProcess):
    """The process that holds every sequence's matcher (grammar_worker.serve_guides): each token's work is a round
    trip waited for at most its budget, and a process past it is killed, so that no grammar holds the engine thread
    longer than that. The sequences it held are carried over to the next process (Guide.open: their tokens taken
    again); `generation` counts the processes, so that each Guide knows whether its matcher is still there."""

    role = "guide"
    stack_bytes = GUIDE_STACK

    def __init__(self, tokenizer: Tokenizer, limits: GrammarLimits) -> None:
        super().__init__(tokenizer, limits)
        self.spare: subprocess.Popen | None = None  # started at the first restart: the next one is then ready
        self.generation = 0
        self.ids = itertools.count()
        self.ended: deque[int] = deque()  # sequences whose matchers may go, told with the next request (any thread)
        self.lock = threading.RLock()  # one round trip at a time; the engine thread holds it for a step's (step())
        self.turn = threading.Condition()  # a build waits while a step waits for the process (step(), build())
        self.steps_waiting = 0
        self.cpu_seen = 0.0  # the process's CPU seconds at its last answer

    def call(self, request: dict[str, Any], seconds: float) -> tuple[dict[str, Any], bytes]:
        """The answer to `request` and the mask after it (llguidance's bitmask, b"" if none); GuideLost when the
        process takes longer than `seconds` or ends, after which the next one takes over."""
        with self.lock:
            self.wait_ready()
            request["drop"] = [self.ended.popleft() for _ in range(len(self.ended))]
            try:
                self.send(json.dumps(request).encode())
                frame = self.receive(seconds)
            except TimeoutError:
                _, cpu = self.restart()
                used = max(cpu - self.cpu_seen, 0.0)
                if used >= seconds / 2:
                    raise GuideLost(f"took over {seconds:g} s", True) from None
                raise GuideLost(f"did not answer within {seconds:g} s, having had the CPU for {used:.2f} s of it "
                                f"(stopped, or the machine is overloaded)", False) from None
            except (BrokenPipeError, EOFError):
                code, _ = self.restart()
                if code in CRASHES:
                    raise GuideLost(f"crashed llguidance ({ended_by(code)})", True) from None
                raise GuideLost(f"ended ({ended_by(code)})", False) from None
        (size,) = struct.unpack(">I", frame[:4])
        answer = json.loads(frame[4:4 + size])
        self.cpu_seen = answer["process_cpu"]
        return answer, frame[4 + size:]

    def wait_ready(self) -> None:
        if not self.ready:
            super().wait_ready()
            self.cpu_seen = self.started_cpu

    def restart(self) -> tuple[int, float]:
        """Kill the process and go on with the spare (its first request waits for it to be ready, if it is not yet),
        starting the next spare: a grammar that gets a process killed once is likely to come again. The killed
        process's exit status and CPU seconds in all."""
        process, self.process = self.process, None
        code, cpu = killed(process)
        self.generation += 1
        spare, self.spare = self.spare, None
        self.process, self.ready = spare or self.spawn(), False
        self.spare = self.spawn()
        return code, cpu

    def stop(self) -> int:
        """Kill the process and the spare; the process's exit status."""
        spare, self.spare = self.spare, None
        if spare is not None:
            killed(spare)
        return super().stop()

    def end(self, sequence: int) -> None:
        self.ended.append(sequence)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Hold the process for one engine step's grammar work (every sequence's token), so that a build (another
        thread's) waits until the step is done, and the step waits for at most the one build already running: a lock
        does not queue its waiters, and builds taken between each sequence's round trip added up (attack 21)."""
        with self.turn:
            self.steps_waiting += 1
        try:
            self.lock.acquire()
        finally:
            with self.turn:
                self.steps_waiting -= 1
                self.turn.notify_all()
        try:
            yield
        finally:
            self.lock.release()

    def build(self, grammar: str, seconds: float) -> str:
        """Build a grammar in the process (a lookup where it is built already); "" or, where it ran the process past
        `seconds` or crashed it, what follows the grammar's name in the error. A process lost for a reason of its
        own is replaced and the build tried there once more; lost again, it is left to the opens."""
        for _ in range(2):
            with self.turn:  # after any step waiting for the process
                self.turn.wait_for(lambda: not self.steps_waiting)
            try:
                answer, _ = self.call({"op": "build", "grammar": grammar}, seconds)
            except GuideLost as e:
                if e.blamed:
                    return f" {e} to build in the guide process; at most {seconds:.2g} s"
                continue
            return f": {answer['error']}" if answer["error"] else ""  # not expected: the compile process built it
        return ""


class Compiled:
    """A checked grammar: llguidance's definition of it, which each sequence's Guide opens in the guide process;
    `cost` is the median CPU seconds of a token in the compile's probe, `build` those of building it. `refused` says
    why it is refused from now on (a sequence ran past a time budget), or is empty."""

    def __init__(self, constraint: Constraint, grammar: str, worker: GuideWorker, vocab_size: int,
                 limits: GrammarLimits, cost: float, build: float) -> None:
        self.constraint, self.grammar, self.worker, self.vocab_size = constraint, grammar, worker, vocab_size
        self.limits, self.cost, self.build = limits, cost, build
        self.refused = ""

    def guide(self) -> Guide:
        return Guide(self)


class Grammars:
    """Compiles constraints for one tokenizer, within `limits`, in the compile process, and keeps the guide process
    that follows them (each started on first use: about a second each, to build llguidance's tokenizer); the last
    CACHED_GRAMMARS grammars are kept by their text, compiled or refused. llguidance never runs in this process.
    Safe to call from several threads (the server compiles off its event loop)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: GrammarLimits = GrammarLimits()) -> None:
        self.tokenizer, self.vocab_size, self.limits = tokenizer, vocab_size, limits
        self.worker = CompileWorker(tokenizer, limits)
        self.guides = GuideWorker(tokenizer, limits)
        atexit.register(self.close)
        self.lock = threading.Lock()  # the cache
        self.worker_lock = threading.Lock()  # one compile at a time in the worker
        # one build at a time waits for the guide process beside the engine thread (a lock does not queue its
        # waiters: several builds could otherwise take it in turn while the engine thread waits)
        self.build_lock = threading.Lock()
        self._cache: OrderedDict[Constraint, Compiled | GrammarError] = OrderedDict()
        # the server's compiles, on threads of their own: they wait for each other (worker_lock, build_lock), and in
        # asyncio's shared pool a flood of them would hold up every other request's work there
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpt2-grammar")

    def compile(self, constraint: Constraint) -> Compiled:
        """The compiled grammar; GrammarError (param 'constraint') naming what is wrong with it or the limit it goes
        over. Blocks for at most about limits.compile_seconds, plus the wait for another compile (and, the first
        time, for the two processes to start)."""
        with self.lock:
            found = self._cache.get(constraint)
            if found is not None:
                self._cache.move_to_end(constraint)
        if isinstance(found, GrammarError):
            raise GrammarError(str(found))
        if found is not None:
            if found.refused:
                raise GrammarError(found.refused)
            self._build(found)  # the guide process may have dropped it since, or been replaced
            return found
        try:
            compiled: Compiled | GrammarError = self._compile(constraint)
        except GrammarError as e:
            compiled = e
        with self.lock:
            self._cache[constraint] = compiled
            if len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        if isinstance(compiled, GrammarError):
            raise GrammarError(str(compiled))
        return compiled

    def _compile(self, constraint: Constraint) -> Compiled:
        self.limits.check(constraint)
        with self.worker_lock:
            grammar, error, cost, build = self.worker.compile(constraint)
        if error:
            raise GrammarError(f"{constraint.describe()}: {error}")
        compiled = Compiled(constraint, grammar, self.guides, self.vocab_size, self.limits, cost, build)
        self._build(compiled)
        return compiled

    def _build(self, compiled: Compiled) -> None:
        """Have the guide process hold the grammar built, off the engine thread, so that its sequences' opens only
        copy it; GrammarError (the grammar refused from now on) where that runs the process past its time."""
        with self.build_lock:
            error = self.guides.build(compiled.grammar, self.limits.step_seconds + 4 * compiled.build)
        if error:
            compiled.refused = f"{compiled.constraint.describe()}{error}"
            raise GrammarError(compiled.refused)

    def close(self) -> None:
        """End the two processes (they also end by themselves when this process does)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        with self.worker_lock:
            self.worker.stop()
        with self.guides.lock:
            self.guides.stop()


class Guide:
    """One sequence's place in its grammar: which tokens may come next, and the tokens it took. Its matcher lives in
    the guide process; each token is one round trip there (take the token, compute the next mask), waited for at
    most limits.step_seconds, and the process is killed past it. A step past that budget, or a sequence whose steps
    cost over token_seconds of CPU on average (past an allowance of ALLOWANCE_TOKENS: the probe takes the lowest
    tokens, a sequence may take a costlier path), ends the sequence (GrammarError) and refuses the grammar from then
    on. `close` lets the process drop the matcher."""

    def __init__(self, compiled: Compiled) -> None:
        self.compiled, self.worker = compiled, compiled.worker
        self.id = next(self.worker.ids)
        self.generation = -1  # of the guide process that holds its matcher; -1: none yet
        self.taken: list[int] = []  # tokens accepted so far, to carry the sequence over to a new process
        self.allowed: np.ndarray | None = None  # [V] 1 where the grammar allows the token next
        self.stopped = False
        self.failed = ""  # the grammar failed computing the next mask: raised where that mask is asked for
        self.spent = 0.0  # CPU seconds of this sequence's masks and advances
        self.built = 0.0  # CPU seconds its opens spent building the grammar (0 where its compile had it built)

    @property
    def tokens(self) -> int:
        return len(self.taken)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] -> a copy with -inf for every token the grammar does not allow next. GrammarError if the grammar fails
        or computing the mask took longer than the step budget."""
        self._check_refused()
        if self.generation != self.worker.generation:
            self._open()
        if self.failed:
            raise GrammarError(self.failed)
        allowed = self.allowed[: logits.shape[-1]]
        if len(allowed) < logits.shape[-1]:  # a padded vocabulary: the padding rows are never allowed
            allowed = np.pad(allowed, (0, logits.shape[-1] - len(allowed)))
        return logits.masked_fill(torch.from_numpy(allowed == 0), -torch.inf)

    def accept(self, token: int) -> None:
        """Advance past `token`, which the mask allowed, and compute the next mask."""
        self._check_refused()
        if self.generation != self.worker.generation:
            self._open()
        self._call({"op": "accept", "id": self.id, "token": token}, f"take token {token} and compute the allowed tokens")
        self.taken.append(token)

    def step(self) -> contextlib.AbstractContextManager[None]:
        """The guide process held for one engine step (GuideWorker.step); the same for every Guide of a Grammars."""
        return self.worker.step()

    def close(self) -> None:
        """The sequence ended: its matcher may go."""
        if self.generation == self.worker.generation:
            self.worker.end(self.id)
        self.generation = -1

    def _open(self) -> None:
        """Open the sequence's matcher in the guide process: the grammar (built there if new to it) and the tokens it
        has taken, if a killed process held it before. Waited for a step's budget and four times what the build and
        the tokens cost in the compile's measure (a process that loses its CPU is not blamed: GuideLost)."""
        limits = self.compiled.limits
        work = self.compiled.build + (self.tokens + ALLOWANCE_TOKENS) * limits.token_seconds
        seconds = limits.step_seconds + 4 * work
        self._call({"op": "open", "id": self.id, "grammar": self.compiled.grammar, "tokens": self.taken},
                   "compute the allowed tokens", seconds)
        self.generation = self.worker.generation

    def _call(self, request: dict[str, Any], what: str, seconds: float | None = None) -> None:
        """Send `request` to the guide process and take its answer: the next mask, or GrammarError. When the process
        is lost for a reason of its own (stopped, starved, killed from outside), the request is tried once more on
        the next process; when the request itself ran it past its time or crashed it, the grammar is refused."""
        c = self.compiled
        seconds = c.limits.step_seconds if seconds is None else seconds
        for attempt in range(2):
            try:
                answer, mask = self.worker.call(request, seconds)
                break
            except GuideLost as e:  # the process is gone with the matchers of the sequences beside: they reopen
                self.generation = -1
                if e.blamed:
                    per = "a token" if request["op"] == "accept" else "to open a sequence"
                    advice = "simplify it" if str(e).startswith("crashed") else f"at most {seconds:g} s {per}"
                    c.refused = f"{c.constraint.describe()} {e} to {what} after {self.tokens} tokens; {advice}"
                    raise GrammarError(c.refused) from None
                if attempt:  # twice in a row, and not its grammar's doing: the sequence ends, the grammar stays
                    raise GrammarError(f"the guide process {e}, twice, when asked to {what} after {self.tokens} "
                                       f"tokens; {c.constraint.describe()} is not at fault: try again") from None
                if request["op"] == "accept":
                    self._open()  # the sequence carried over to the next process, then its token sent again
        self.spent += answer["cpu"]
        self.built += answer.get("built", 0.0)
        if answer["at"] == "mask":
            self.failed = self._failure(answer, request)
        elif answer["error"] or not answer["consumed"]:
            raise GrammarError(self._failure(answer, request))
        if self.spent > (self.tokens + 1 + ALLOWANCE_TOKENS) * c.limits.token_seconds:
            c.refused = (f"{c.constraint.describe()} took {self.spent * 1e3:.0f} ms of CPU over {self.tokens + 1} "
                         f"tokens; at most {c.limits.token_seconds * 1e3:g} ms a token on average")
            raise GrammarError(c.refused)
        self.stopped = answer["stopped"]
        self.allowed = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[: self.compiled.vocab_size]

    def _failure(self, answer: dict[str, Any], request: dict[str, Any]) -> str:
        """The message of a failed answer; a grammar that ran out of a token's lexer fuel (limits.step_fuel) is
        refused from then on, as a step past the time budget is: it would fail the same way again."""
        if answer["at"] == "open":  # not expected: the compile process built it the same way
            return f"{self.compiled.constraint.describe()}: {answer['error']}"
        if answer["at"] == "mask":
            where = f"the grammar failed after {self.tokens + (request['op'] == 'accept')} tokens"
        else:
            where = f"the grammar failed at token {request.get('token')} (after {self.tokens})"
        error = f"{where}: {answer['error']}" if answer["error"] else where
        if "lexer fuel" in error:
            self.compiled.refused = f"{self.compiled.constraint.describe()}: {error}"
        return error

    def _check_refused(self) -> None:
        if self.compiled.refused:  # by a sequence beside this one, maybe in this very step: not paid for again
            raise GrammarError(self.compiled.refused)

    @property
    def finished(self) -> bool:
        """Whether the grammar allows nothing more (not even more text: only the end)."""
        return self.stopped


def grammar_failure(error: str) -> str | None:
    """The message of a sequence's error event (the scheduler's "Type: message") when its grammar caused it, else
    None: a fault of the request, not of the engine."""
    prefix = f"{GrammarError.__name__}: "
    return error[len(prefix):] if error.startswith(prefix) else None

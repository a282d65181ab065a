"""Where llguidance runs: the compile process, and the guide process that follows every sequence's grammar, so that
a grammar on which llguidance crashes or runs away kills one of them, never the engine.

llguidance's compiler recurses once per level of a grammar (a chain of rules, of JSON-schema $refs), about 3.4 KB of
stack a level, and a deep enough grammar overflows the stack: a SIGSEGV that no Python code can catch. Its fuel
bounds most of the work of a step but not all of it: a long literal costs it seconds a token. So
runtime/constraints.py checks a grammar's text first, then sends it to the compile process (its first mask computed,
16 tokens taken on a copy: `probe`) and waits a bounded time. What passes is built again in the guide process, on a
stack four times the compile process's, and each sequence's tokens are taken there, one request each, timed by the
parent, which kills the process past its budget.

Run by constraints.WorkerProcess (the standard library's runpy on this file, `python -I`): it imports only the
standard library, tiktoken and llguidance. Frames on stdin and stdout are an 8-byte big-endian length and a payload:
the first inbound frame is the pickled setup from the parent (its own trusted process), the rest JSON requests, one
answer each (JSON from the compile role; from the guide role, JSON and the mask's bytes: serve_guides).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import select
import signal
import statistics
import struct
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, BinaryIO

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
NO_TEXT = ("NoExtension", "NoExtensionBias")  # llguidance's stop reasons at the first mask: nothing can be generated
# Lark, as llguidance tells it from GBNF (a `start` rule or a %llguidance block), and `?start:` as Lark's own docs
# write its JSON grammar (llguidance would read that as GBNF and fail to convert it)
LARK_SYNTAX = re.compile(r"(?m)^\s*(%llguidance\b|[?!]?start\s*(?:\.-?\d+)?\s*(?:\[[^\]\n]*\])?\s*:)")
PROBE_TOKENS = 16  # tokens a compile takes on a copy of the matcher: a grammar that fails or is slow on its first ones


def definition(kind: str, spec: str, whitespace_flexible: bool = False) -> str:
    """The constraint in llguidance's form (not yet checked); ValueError names what is wrong. JSON comes compact (no
    whitespace outside strings) unless `whitespace_flexible`; a schema's own "x-guidance" options still apply."""
    import llguidance

    options = {"whitespace_flexible": whitespace_flexible}
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
    if kind == "json_schema":
        schema = json.loads(spec)
        if schema is False:
            raise ValueError("the schema false matches no text")
        return llguidance.LLMatcher.grammar_from_json_schema({} if schema is True else schema, defaults=options)
    if kind == "choice":  # each choice a quoted Lark string: any text, nothing of it read as grammar
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    if kind == "regex":
        return llguidance.grammar_from("regex", spec)
    if kind == "grammar":  # Lark, or GBNF converted to Lark
        return llguidance.grammar_from("lark" if LARK_SYNTAX.search(spec) else "grammar", spec)
    raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {kind!r}")


def parser_limits(lexer_fuel: int, step_fuel: int, row_items: int) -> Any:
    """llguidance's limits for every matcher: its lexer fuel lowered, at the start (1,000,000 by default; counted
    repetitions such as `(a{1000}){1000}` spend it quadratically, for minutes) and for each token (200,000 by default:
    about a second of lexer work on `(a|aa)*b{720000}` once a `b` is taken, where 20,000 is about 10 ms), so a grammar
    that would stall the engine loop fails its sequence instead; the Earley items of one row a little above its
    2,000 (a list of 2,000 choices holds 2,001 once their common prefix is taken); and errors without its dump of the
    parser's state."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=lexer_fuel, step_lexer_fuel=step_fuel,
                                     max_items_in_row=row_items, verbose_errors=False)


def check(lltokenizer: Any, grammar: str, limits: Any) -> tuple[Any, str]:
    """A matcher for `grammar` with its first mask computed (the step that builds most of the lexer), and "" or the
    one-line reason it cannot generate."""
    import llguidance

    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0, limits=limits)
    if not matcher.is_error():
        matcher.compute_bitmask()
    return matcher, matcher_error(matcher)


def probe(lltokenizer: Any, matcher: Any, tokens: int, step_seconds: float, token_seconds: float,
          allowance: int) -> tuple[str, float]:
    """("" or why the grammar is refused, the median CPU seconds of its steps): a copy of `matcher` takes up to
    `tokens` tokens, each the lowest id allowed (mostly single bytes: the lexer's work), each step's mask and advance
    timed. A grammar whose lexer runs out of fuel on its first characters (`a{100000}`), whose step runs past
    `step_seconds`, or whose tokens cost more than `token_seconds` of CPU (`e{9990}`: a long literal costs about the
    square of its length at every token) is refused here, rather than slowing every sequence it is decoded beside:
    the median where the text goes on for all `tokens`, else what the runtime holds a sequence to (its total within
    `allowance` tokens more than it took), so that a short text (one of 2,000 choices) is not judged per token.
    CPU time, the thread's own, so that other work on the machine does not make a cheap grammar look slow."""
    walker, costs = matcher.deep_copy(), []
    for step in range(tokens):
        t0, c0 = time.perf_counter(), time.thread_time()
        allowed = int.from_bytes(walker.compute_bitmask(), "little")
        token = (allowed & -allowed).bit_length() - 1  # the lowest allowed id
        if walker.is_error() or token < 0 or token == lltokenizer.eos_token:
            break
        walker.consume_token(token)
        seconds, cost = time.perf_counter() - t0, time.thread_time() - c0
        if walker.is_error():
            return matcher_error(walker), 0.0
        if seconds > step_seconds:
            return (f"took {seconds:.1f} s to compute the allowed tokens at its token {step + 1}; at most "
                    f"{step_seconds:g} s a token"), 0.0
        costs.append(cost)
        if walker.is_stopped():
            break
    median = statistics.median(costs) if costs else 0.0
    if len(costs) == tokens and median > token_seconds:
        return (f"costs {median * 1e3:.1f} ms of CPU a token to follow (the median of its first {len(costs)}); at "
                f"most {token_seconds * 1e3:g} ms"), median
    if sum(costs) > (len(costs) + allowance) * token_seconds:
        return (f"costs {sum(costs) * 1e3:.0f} ms of CPU over its {len(costs)} tokens; at most "
                f"{token_seconds * 1e3:g} ms a token past {allowance} tokens' worth"), median
    return "", median


def matcher_error(matcher: Any) -> str:
    """A matcher's error as one line, "" if none: llguidance's stop reasons and limits in words."""
    if not matcher.is_error():
        return ""
    error = one_line(matcher.get_error().replace("<non-verbose/>", ""))
    if error in NO_TEXT:  # at the first mask, e.g. a JSON schema that is a $ref loop
        return "no text matches it (a $ref loop, or conditions that no value meets)"
    if "too many expressions constructed" in error:  # counted repetitions such as a{100000}, expanded
        return f"{error} (over llguidance's lexer fuel: a regex too large once its repetitions are expanded)"
    return error


def one_line(text: str) -> str:
    """llguidance's message as one line of at most 300 characters, what its terms mean added where they are terse."""
    line = " ".join(text.split())[:300]
    if line.startswith("Unimplemented keys:"):  # JSON Schema keywords llguidance cannot enforce, such as uniqueItems
        line += " (JSON Schema keywords llguidance cannot enforce; expected a schema without them)"
    return line


# --- the worker process ---------------------------------------------------------------------------------------------

def read_frame(stream: BinaryIO) -> bytes | None:
    """One frame's payload, or None at the end of the stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack(">Q", head)
    return stream.read(size)


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(struct.pack(">Q", len(payload)) + payload)
    stream.flush()


def main() -> None:
    """Serve the parent: after the pickled setup, its "role" says which loop runs, on a thread whose stack is the
    setup's: "compile" (answer_one: two frames a request, {"build"} as soon as the grammar is built and then the
    answer, each timed by the parent) or "guide" (serve_guides)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle; this process ends at its EOF
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = pickle.loads(read_frame(stdin))
    from llguidance.tiktoken import lltokenizer_from_encoding

    lltokenizer = lltokenizer_from_encoding(setup["encoding"], n_vocab=setup["n_vocab"], eos_token=setup["eos"])
    limits = parser_limits(setup["lexer_fuel"], setup["step_fuel"], setup["row_items"])
    threading.stack_size(setup["stack_bytes"])  # llguidance recurses once per level of a grammar: see the docstring
    write_frame(stdout, json.dumps({"ready": True, "cpu": time.process_time()}).encode())
    if setup["role"] == "guide":
        thread = threading.Thread(target=serve_guides, args=(lltokenizer, limits, setup["kept_built"], stdin, stdout),
                                  daemon=True)
        thread.start()
        thread.join()
        return
    while (frame := read_frame(stdin)) is not None:
        answer: dict[str, Any] = {}
        built = threading.Event()
        thread = threading.Thread(target=answer_one, args=(lltokenizer, limits, json.loads(frame), answer, built),
                                  daemon=True)
        thread.start()
        wait_for(thread, built, stdin)
        write_frame(stdout, json.dumps({"build": answer.get("build", 0.0)}).encode())  # timed apart by the parent
        wait_for(thread, None, stdin)
        write_frame(stdout, json.dumps(answer).encode())


def wait_for(thread: threading.Thread, event: threading.Event | None, stdin: BinaryIO) -> None:
    """Wait until `event` is set or `thread` ends, the process ending if the parent has gone: it sends nothing while
    it waits, so stdin readable here is its end."""
    while thread.is_alive() and not (event is not None and event.is_set()):
        if event is not None:
            event.wait(0.1)
        else:
            thread.join(0.1)
        if thread.is_alive() and select.select([stdin], [], [], 0)[0]:
            os._exit(0)


def answer_one(lltokenizer: Any, limits: Any, request: dict[str, Any], answer: dict[str, Any],
               built: threading.Event) -> None:
    """Fill `answer` for one request: llguidance's definition of the constraint, "" or why it cannot generate, what a
    token of it costs, and the CPU seconds of building it (its first mask included: what the guide process will
    spend on it again), `built` set as soon as that is known."""
    answer.update(grammar="", error="", cost=0.0, build=0.0)
    try:
        grammar = definition(request["kind"], request["spec"], request["whitespace_flexible"])
        c0 = time.thread_time()
        matcher, error = check(lltokenizer, grammar, limits)
        answer.update(grammar=grammar, error=error, build=time.thread_time() - c0)
        built.set()
        if not error:
            answer["error"], answer["cost"] = probe(lltokenizer, matcher, PROBE_TOKENS, request["step_seconds"],
                                                    request["token_seconds"], request["allowance_tokens"])
    except (ValueError, TypeError, RecursionError) as e:
        answer.update(grammar="", error=one_line(str(e)) or type(e).__name__)


# --- the guide role: every sequence's matcher, each token's work timed by the parent ---------------------------------

def serve_guides(lltokenizer: Any, limits: Any, kept: int, stdin: BinaryIO, stdout: BinaryIO) -> None:
    """Answer each request ({"op": "build", "grammar"}, {"op": "open", "id", "grammar", "tokens"} or {"op":
    "accept", "id", "token"}, each with "drop": ids whose sequences ended) with one frame: a 4-byte big-endian
    length, the JSON answer ({"consumed", "error", "at", "stopped", "cpu", "process_cpu"}) and the sequence's next
    mask (llguidance's bitmask bytes; none after an error). Grammars are built once (the last `kept` of them kept)
    and each sequence works on a copy."""
    built: OrderedDict[str, Any] = OrderedDict()
    matchers: dict[int, Any] = {}
    while (frame := read_frame(stdin)) is not None:
        request = json.loads(frame)
        for ended in request["drop"]:
            matchers.pop(ended, None)
        answer, mask = guide_step(lltokenizer, limits, (built, kept), matchers, request)
        answer["process_cpu"] = time.process_time()  # what the parent tells a step's own CPU from, if it kills this
        text = json.dumps(answer).encode()
        write_frame(stdout, struct.pack(">I", len(text)) + text + mask)


def guide_step(lltokenizer: Any, limits: Any, cache: tuple[OrderedDict[str, Any], int], matchers: dict[int, Any],
               request: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """One request's answer and mask: a "build" builds a grammar (when it is compiled, so that no sequence waits for
    that); an "open" copies the grammar's built matcher for the sequence and takes the tokens it had taken (a
    sequence carried over from a process that was killed) and an "accept" takes one; then the next mask is
    computed. "cpu" is the thread's CPU seconds for it, an open's build not counted (the compile's cost)."""
    building = 0.0
    if request["op"] in ("open", "build"):
        c0, new = time.thread_time(), request["grammar"] not in cache[0]
        built_matcher, error = pristine(lltokenizer, limits, cache, request["grammar"])
        building = time.thread_time() - c0 if new else 0.0
        if error or request["op"] == "build":
            return {"consumed": not error, "error": error, "at": "open", "stopped": False, "cpu": building}, b""
        c0 = time.thread_time()
        matcher = matchers[request["id"]] = built_matcher.deep_copy()
        tokens = request["tokens"]
    else:
        c0 = time.thread_time()
        matcher, tokens = matchers[request["id"]], [request["token"]]
    answer: dict[str, Any] = {"consumed": True, "error": "", "at": "accept", "stopped": False, "built": building}
    mask = b""
    for token in tokens:
        if not matcher.consume_token(token) or matcher.is_error():
            answer.update(consumed=False, error=matcher_error(matcher))
            break
    else:
        mask = matcher.compute_bitmask()
        if error := matcher_error(matcher):
            answer.update(error=error, at="mask")
            mask = b""
        answer["stopped"] = matcher.is_stopped()
    answer["cpu"] = time.thread_time() - c0
    return answer, mask


def pristine(lltokenizer: Any, limits: Any, cache: tuple[OrderedDict[str, Any], int], grammar: str) -> tuple[Any, str]:
    """The matcher of `grammar` as built (its first mask computed), from the cache (the built matchers by grammar, and
    how many are kept) or built now; and "" or why not."""
    built, kept = cache
    if grammar in built:
        built.move_to_end(grammar)
        return built[grammar], ""
    matcher, error = check(lltokenizer, grammar, limits)
    if not error:
        built[grammar] = matcher
        if len(built) > kept:
            built.popitem(last=False)
    return matcher, error


if __name__ == "__main__":
    main()

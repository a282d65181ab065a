"""Structured output on llguidance: JSON schemas, regexes, choices and grammars hold on every sample, through the
Python API, `gpt2 generate` and a real `gpt2 serve` with the `openai` client; the mask sits before the sampler's
filters, constrained and free rows share passes exactly, and speculative decoding stays exact under a grammar."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from test_serve import live

from gpt2_engine import GPT2, Constraint, GenerationError
from gpt2_engine.runtime.constraints import GrammarError, GrammarLimits, Grammars, GuideLost
from gpt2_engine.runtime.grammar_text import longest_literal

openai = pytest.importorskip("openai", reason="the openai client is part of the test extra")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"enum": ["file", "dir", "link"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"uid": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "admin": {"type": "boolean"}},
                  "required": ["uid", "admin"], "additionalProperties": False},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "size", "kind", "tags", "owner", "ratio"],
    "additionalProperties": False,
}
BOUNDED = {  # compact JSON of it has a bounded length: no free string or number
    "type": "object",
    "properties": {
        "kind": {"enum": ["file", "dir", "link"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 9999},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"uid": {"type": "integer", "minimum": 0, "maximum": 999}},
                  "required": ["uid"], "additionalProperties": False},
    },
    "required": ["kind", "size", "admin", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{2})?"
CHOICES = ["file", "directory", "link", "socket"]


def rule_chain(n: int) -> str:
    """A Lark grammar of n + 2 rules, each only the next: start -> r0 -> ... -> r{n} -> "a". llguidance's compiler
    recurses once per rule and overflows an 8 MB stack (SIGSEGV) at about 3,000."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def outside_strings(text: str) -> str:
    """JSON text with its complete strings' contents removed."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', "", text)


def test_constraints_are_checked_with_one_line_errors(trained_model: GPT2) -> None:
    bad = [(lambda: Constraint.choice([]), "choice must be a non-empty list of non-empty strings"),
           (lambda: Constraint.choice("ab"), "choice must be a non-empty list"),
           (lambda: Constraint.choice([f"c{i}" for i in range(10_000)]), "choice: over 2,000 choices; expected at most 2,000"),
           (lambda: Constraint.json_schema("{not json"), "the JSON schema is not valid JSON"),
           (lambda: Constraint("xml"), "constraint kind must be one of json_schema, json_object, regex, choice, grammar"),
           (lambda: trained_model.generate("x", constraint=Constraint.regex("[0-9")), "the regex '[0-9': "),
           (lambda: trained_model.generate("x", constraint=Constraint.json_schema({"type": "objekt"})),
            "the JSON schema: Invalid type: objekt"),
           (lambda: Constraint.json_schema(False), "a JSON schema must be an object, or its JSON text (true is taken "
                                                    "as {}: any JSON), got false"),  # false matches no text
           (lambda: Constraint.json_schema("0"), "a JSON schema must be an object, or its JSON text (true is taken "
                                                 "as {}: any JSON), got 0"),
           (lambda: Constraint.json_schema({"type": {"integer", "string"}}), "the JSON schema must hold only JSON "
            "values (dicts with string keys, lists, strings, numbers, booleans, None): Object of type set is not JSON "
            "serializable"),  # a raw TypeError
           (lambda: Constraint.choice(5), "choice must be a non-empty list of non-empty strings, got int"),
           (lambda: Constraint.choice(c for c in ("a", "")), "choice must be a non-empty list of non-empty strings, "
                                                              "got ['a', '']"),
           (lambda: trained_model.generate("x", constraint=Constraint.json_schema({"$ref": "#"})),
            "the JSON schema: no text matches it (a $ref loop, or conditions that no value meets)"),
           (lambda: trained_model.generate("x", constraint=Constraint.choice(["a"]), ignore_eos=True),
            "ignore_eos cannot be combined with a constraint"),
           (lambda: trained_model.generate("x", constraint={"regex": "a"}), "constraint must be a Constraint"),
           (lambda: trained_model.generate("x", constraint=Constraint.json_schema({"type": "array",
                                                                                   "uniqueItems": True})),
            'the JSON schema: Unimplemented keys: ["uniqueItems"] (JSON Schema keywords llguidance cannot enforce; '
            'expected a schema without them)')]
    for call, message in bad:
        with pytest.raises(GenerationError, match=re.escape(message)) as e:
            call()
        assert "\n" not in str(e.value)
    # any iterable of strings is a list of choices (a generator was a raw TypeError); true is JSON Schema's {}
    assert Constraint.choice(c for c in ("yes", "no")) == Constraint.choice(("yes", "no")) == Constraint.choice(["yes", "no"])
    assert Constraint.json_schema(True) == Constraint.json_schema("true") == Constraint.json_schema({})


def test_every_sample_matches_its_constraint(trained_model: GPT2) -> None:
    for constraint, check in [(Constraint.json_schema(SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
                              (Constraint.regex(REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
                              (Constraint.choice(CHOICES), lambda t: t in CHOICES or pytest.fail(t))]:
        outs = trained_model.complete(["Return the"], max_new_tokens=120, temperature=1.0, top_k=0, seed=7,
                                      num_samples=12, constraint=constraint)
        for out in outs:
            assert out.finish_reason in ("stop", "eos"), (constraint.kind, out.text)  # the grammar completed
            check(out.text)
        assert len({o.text for o in outs}) > 1  # sampled, not one forced string


def test_the_mask_comes_before_the_filters(trained_model: GPT2) -> None:
    """top_k 1 within the allowed tokens is greedy among them: the same as temperature 0 under the grammar, although
    the model's own top token is not allowed (the filters see only the allowed tokens)."""
    c = Constraint.regex("[0-9]{4}")
    greedy = trained_model.complete(["Return the"], max_new_tokens=8, temperature=0, constraint=c)[0]
    top1 = trained_model.complete(["Return the"], max_new_tokens=8, temperature=1.0, top_k=1, seed=3, constraint=c)[0]
    assert greedy.token_ids == top1.token_ids and re.fullmatch("[0-9]{4}", greedy.text)
    free = trained_model.complete(["Return the"], max_new_tokens=1, temperature=0)[0]
    assert not free.text.strip().isdigit()  # the unconstrained choice is not a digit


def test_greedy_choice_is_the_choice_the_model_scores_highest(trained_model: GPT2) -> None:
    """Choices of one token each: the greedy path is the full choice with the highest log-probability."""
    tok = trained_model.tokenizer
    choices = [" file", " list", " value", " string", " number"]
    assert all(len(tok.encode(c)) == 1 for c in choices)
    for prompt in ["Return the", "The default", "If the given"]:
        out = trained_model.complete([prompt], max_new_tokens=4, temperature=0, constraint=Constraint.choice(choices))[0]
        ids = tok.encode(prompt)
        with torch.no_grad():
            logprobs = torch.log_softmax(trained_model(torch.tensor([ids]))[0, -1], -1)
        best = max(choices, key=lambda c: logprobs[tok.encode(c)[0]].item())
        assert out.text == best and out.finish_reason == "stop"


def test_a_length_cut_is_not_a_completed_grammar(trained_model: GPT2) -> None:
    out = trained_model.complete(["Return the"], max_new_tokens=3, temperature=0,
                                 constraint=Constraint.json_schema(SCHEMA))[0]
    assert out.finish_reason == "length" and out.text.startswith("{")


@pytest.mark.parametrize("drafter", ["ngram", "int4"])
def test_speculation_under_a_grammar_gives_the_same_ids(trained_model: GPT2, drafter: str) -> None:
    passes = 0
    for constraint in (Constraint.json_schema(SCHEMA), Constraint.regex(REGEX)):
        kwargs = dict(max_new_tokens=80, temperature=0, constraint=constraint)
        plain = trained_model.complete(["Return the name of the file"], **kwargs)[0]
        spec = trained_model.generation(["Return the name of the file"], speculate=drafter, draft_tokens=4,
                                        **kwargs)
        assert spec.run()[0].token_ids == plain.token_ids
        passes += spec.stats.verify_passes
    assert passes > 0  # drafts were verified under the grammar (the JSON's; the regex's text is short)


def test_gpt2_generate_flags(trained_dir: Path, tmp_path: Path) -> None:
    def gpt2(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpt2_engine", "generate", "Return the", "--weights",
                               str(trained_dir), *args], capture_output=True, text=True, timeout=120)

    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    out = gpt2("--json-schema", str(tmp_path / "schema.json"), "-n", "120", "--seed", "1")
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), SCHEMA)
    out = gpt2("--choice", "yes", "--choice", "no", "--temperature", "0")
    assert out.returncode == 0 and out.stdout.strip() in ("yes", "no")
    (tmp_path / "g.gbnf").write_text('root ::= "a" [0-9] [0-9] | "b"\n')
    out = gpt2("--grammar", str(tmp_path / "g.gbnf"), "--seed", "2")
    assert out.returncode == 0 and re.fullmatch(r"a[0-9]{2}|b", out.stdout.strip()), out
    (tmp_path / "chain.lark").write_text(rule_chain(20_000))
    for args, message in [(("--regex", "a", "--choice", "b"), "give one structured-output flag, not --regex and --choice"),
                          (("--json-schema", str(tmp_path / "missing.json")), "--json-schema"),
                          (("--regex", "[0-9"), "the regex '[0-9': "),
                          (("--grammar", str(tmp_path / "chain.lark")),
                           "--grammar: the grammar has 20,002 rules; at most 1,000"),
                          (("--regex", "a", "--whitespace-flexible"),
                           "--whitespace-flexible applies to --json-schema or --json-object")]:
        bad = gpt2(*args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and message in bad.stderr, bad.stderr


@pytest.fixture(scope="module")
def server(trained_server: str) -> str:
    return trained_server  # the session's one server (conftest.py)


@pytest.fixture(scope="module")
def client(server: str):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.long
def test_fifty_sampled_requests_per_kind_through_gpt2_serve(client) -> None:
    kinds = [
        # the legacy completions API has no response_format in the client's signature: vLLM takes it in the body
        (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMA}}}),
         lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        (dict(extra_body={"structured_outputs": {"regex": REGEX}}), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
        (dict(extra_body={"structured_outputs": {"choice": CHOICES}}), lambda t: t in CHOICES or pytest.fail(t)),
    ]
    for kwargs, check in kinds:
        def one(seed: int, kwargs=kwargs):
            return client.completions.create(model="gpt2", prompt="Return the", max_tokens=150, temperature=1.0,
                                             seed=seed, **kwargs).choices[0]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            choices = list(pool.map(one, range(50)))
        for c in choices:
            assert c.finish_reason == "stop", c.text
            check(c.text)


def test_chat_with_a_json_schema(client) -> None:
    out = client.chat.completions.create(
        model="gpt2", messages=[{"role": "user", "content": "Describe the file."}], temperature=0.8, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "entry", "schema": SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,param,fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "response_format",
     "Invalid type: objekt"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format json_schema needs"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "the regex '[0-9'"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
    ({"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "ignore_eos", "ignore_eos cannot be combined"),
    # a $ref loop: no text matches it (a 500 with llguidance's dump of its parser state, before)
    ({"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs",
     "the JSON schema: no text matches it (a $ref loop, or conditions that no value meets)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}},
     "response_format", "the JSON schema: no text matches it"),
    # the limits, checked before llguidance sees the grammar
    ({"structured_outputs": {"grammar": rule_chain(2_999)}}, "structured_outputs",
     "the grammar has 3,001 rules; at most 1,000"),
    ({"structured_outputs": {"json": {"enum": ["x" * 100_000, "y" * 100_000]}}}, "structured_outputs",
     "the JSON schema is 200,018 bytes; at most 100,000"),
    ({"structured_outputs": {"choice": ["no", "x" * 20_000]}}, "structured_outputs",
     "the list of choices has a literal of 20,000 characters; at most 1,000"),
    ({"structured_outputs": {"grammar": 'start: "a" | /' + "b" * 12_000 + "/"}}, "structured_outputs",
     "the grammar has a literal of 12,000 characters; at most 1,000"),
    ({"structured_outputs": {"json": {"anyOf": [{"$ref": "#/$defs/a"}] * 1_001, "$defs": {"a": {"type": "null"}}}}},
     "structured_outputs", "the JSON schema has 1,001 $refs; at most 1,000"),
    ({"structured_outputs": {"json": json.loads('{"type": "array", "items": ' * 70 + "{}" + "}" * 70)}},
     "structured_outputs", "the JSON schema nests 71 levels deep; at most 64"),
    # the whitespace opt-in
    ({"structured_outputs": {"regex": "a", "whitespace_flexible": True}}, "structured_outputs",
     "structured_outputs.whitespace_flexible applies to json and json_object, not regex"),
    ({"response_format": {"type": "json_object", "whitespace_flexible": "yes"}}, "response_format",
     "response_format.whitespace_flexible must be true or false, got 'yes'"),
    # typed as vLLM types them: "yes" was json_object, false and 0 "none" given, the schema false "matches no text"
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs",
     'structured_outputs.json_object must be true or false, got "yes"'),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs",
     "structured_outputs.json_object must be true or false, got 1"),
    ({"structured_outputs": {"json": False}}, "structured_outputs",
     "a JSON schema must be an object, or its JSON text (true is taken as {}: any JSON), got false"),
    ({"structured_outputs": {"json": 0}}, "structured_outputs",
     "a JSON schema must be an object, or its JSON text (true is taken as {}: any JSON), got 0"),
    ({"structured_outputs": {"json_object": False, "regex": "a", "json": {"type": "string"}}}, "structured_outputs",
     "structured_outputs must give exactly one of choice, regex, json, grammar, json_object; got regex, json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "no", "schema": False}}}, "response_format",
     "a JSON schema must be an object, or its JSON text (true is taken as {}: any JSON), got false"),
])
def test_bad_constraints_are_400s_naming_the_field(server: str, body: dict, param: str, fragment: str) -> None:
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
    assert "\n" not in err["message"] and len(err["message"]) <= 400 and "<state>" not in err["message"], err


def test_constrained_and_free_rows_in_one_batch_each_equal_their_run_alone(trained_model: GPT2) -> None:
    bodies = [{"prompt": "Return the", "max_tokens": 40, "temperature": 0},
              {"prompt": "Return the", "max_tokens": 200, "temperature": 0.9, "seed": 5,
               "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMA}}},
              {"prompt": "The default", "max_tokens": 40, "temperature": 0.9, "seed": 6,
               "structured_outputs": {"regex": REGEX}},
              {"prompt": "If the", "max_tokens": 40, "temperature": 0.9, "seed": 7}]
    with live(trained_model, parallel=4, max_queue=8) as (url, _):
        alone = [httpx.post(f"{url}/v1/completions", json=b, timeout=60).json()["choices"][0]["text"] for b in bodies]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda b: httpx.post(f"{url}/v1/completions", json=b, timeout=60).json(), bodies))
    assert [t["choices"][0]["text"] for t in together] == alone
    assert together[1]["choices"][0]["finish_reason"] == "stop"  # the grammar completed within max_tokens
    jsonschema.validate(json.loads(alone[1]), SCHEMA)
    assert re.fullmatch(REGEX, alone[2])


# --- hostile grammars (issue #57: items 1, 2, 6 and 7) ---------------------------------------------------------------

def test_a_chain_of_20000_rules_is_a_400_and_the_server_stays_up(server: str) -> None:
    """Item 1: 20,000 rules (about 280 KB, under the body limit) killed the process with SIGSEGV inside llguidance."""
    r = httpx.post(f"{server}/v1/completions", timeout=60,
                   json={"prompt": "x", "structured_outputs": {"grammar": rule_chain(20_000)}})
    assert r.status_code == 400 and r.json() == {"error": {
        "message": "the grammar has 20,002 rules; at most 1,000", "type": "invalid_request_error",
        "param": "structured_outputs", "code": None}}, r.text
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
    after = httpx.post(f"{server}/v1/completions", timeout=60,
                       json={"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[0-9]{3}"}})
    assert after.status_code == 200 and re.fullmatch("[0-9]{3}", after.json()["choices"][0]["text"]), after.text


def test_a_schema_holding_nan_is_a_400_not_null(server: str) -> None:
    """The fourteenth attack: {"const": NaN} in a request body (Python's JSON reader takes NaN) generated `null`."""
    r = httpx.post(f"{server}/v1/completions", timeout=60, headers={"Content-Type": "application/json"},
                   content=b'{"prompt": "Answer:", "max_tokens": 5, "temperature": 0, '
                           b'"structured_outputs": {"json": {"const": NaN}}}')
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "the JSON schema holds NaN or Infinity, which are not JSON numbers (llguidance would read them as "
                   "null); expected finite numbers", "type": "invalid_request_error", "param": "structured_outputs",
        "code": None}, r.text


def test_a_crash_or_a_runaway_of_the_grammar_compiler_costs_only_its_process(trained_model: GPT2) -> None:
    """With the rule limit lifted, the chain reaches llguidance and crashes it, in the compile process; with the lexer
    fuel at llguidance's default, a counted repetition compiles for minutes, and the process is killed at the build's
    time limit (four times GrammarLimits.build_seconds, in wall time). Each is a GrammarError, and the next grammar
    compiles in a fresh process."""
    tok = trained_model.tokenizer
    grammars = Grammars(tok, trained_model.config.vocab_size,
                        GrammarLimits(max_rules=10**6, max_bytes=10**6, compile_seconds=1.0, lexer_fuel=1_000_000))
    try:
        with pytest.raises(GrammarError, match=r"^the grammar crashed llguidance's compiler \(signal SIG[A-Z]+\); "
                                               r"simplify it$"):
            grammars.compile(Constraint.grammar(rule_chain(20_000)))
        assert grammars.worker.process is None
        with pytest.raises(GrammarError, match=r"^the regex '\(a\{1000\}\)\{1000\}' took over 0.4 s to build "
                                               r"\(llguidance's compile and first mask\); at most 0.1 s of CPU$"):
            grammars.compile(Constraint.regex("(a{1000}){1000}"))
        assert grammars.worker.process is None
        guide = grammars.compile(Constraint.regex("[0-9]{3}")).guide()
        allowed = guide.mask(torch.zeros(trained_model.config.vocab_size)) > -torch.inf
        assert allowed[tok.encode("7")[0]] and not allowed[tok.encode("a")[0]]
        # refused grammars are remembered: the same text is refused without another compile
        with pytest.raises(GrammarError, match="crashed llguidance's compiler"):
            grammars.compile(Constraint.grammar(rule_chain(20_000)))
    finally:
        grammars.close()


def test_a_step_past_the_budget_ends_its_sequence_and_the_grammar_is_refused(trained_model: GPT2) -> None:
    """A long literal costs llguidance about a second a token whatever its fuel (30,000 characters, past the default
    literal limit, lifted here). The compile's probe takes the lowest allowed tokens, "!" here, and does not meet it;
    the generation does: the step that runs over ends the sequence, and the grammar is refused from then on."""
    grammars = Grammars(trained_model.tokenizer, trained_model.config.vocab_size,
                        GrammarLimits(step_seconds=0.05, max_literal=100_000, token_seconds=1.0))
    constraint = Constraint.json_schema({"anyOf": [{"const": "!"}, {"const": "x" * 30_000}]})
    guide = grammars.compile(constraint).guide()
    logits = torch.zeros(trained_model.config.vocab_size)
    # past the time budget, or past a token's lexer fuel first (which comes first depends on the machine's speed)
    message = (r"^the JSON schema took over 0.05 s to take token [0-9]+ and compute the allowed tokens after [0-9]+ "
               r"tokens; at most 0.05 s a token$|lexer fuel")
    try:
        # on the probe's path: a token's lexer fuel (GrammarLimits.step_fuel) runs out before the step's time does
        with pytest.raises(GrammarError, match=r"^the JSON schema: lexer error: too many expressions constructed \(over "
                                               r"llguidance's lexer fuel: "):
            grammars.compile(Constraint.json_schema({"enum": ["x" * 30_000, "y" * 30_000]}))
        with pytest.raises(GrammarError, match=message):
            for token in trained_model.tokenizer.encode('"' + "x" * 400):
                guide.mask(logits)
                guide.accept(token)
        with pytest.raises(GrammarError, match=message):
            grammars.compile(constraint)
    finally:
        grammars.close()


def follow(guide, tokens: list[int], vocab: int) -> torch.Tensor:
    """Take `tokens` through a guide, each allowed by the mask before it; the mask after the last."""
    logits = torch.zeros(vocab)
    for token in tokens:
        assert guide.mask(logits)[token] == 0, token
        guide.accept(token)
    return guide.mask(logits) > -torch.inf


def stop(pid: int) -> None:
    """SIGSTOP a child process and wait until it has stopped (a signal lands later than kill() returns)."""
    os.kill(pid, signal.SIGSTOP)
    assert os.WIFSTOPPED(os.waitpid(pid, os.WUNTRACED)[1])


def test_a_step_is_cut_off_at_its_budget_and_the_sequences_beside_go_on(trained_model: GPT2) -> None:
    """The bound that does not depend on reading a grammar's text: the thirteenth attack's grammar, its text check
    lifted, costs ~5 s of CPU in the step after "b" (a literal of 99,000 bytes), which llguidance cannot interrupt.
    The step runs in the guide process, which is killed at the step budget; the grammar is refused from then on, and
    a sequence beside it (another grammar, in the same process) is carried over to the next process and goes on as if
    nothing had happened. A process stopped or killed from outside is not the grammar's doing (it kept the CPU
    busy for under half the wait, or did not crash): the step is tried again on the next process."""
    tok, vocab = trained_model.tokenizer, trained_model.config.vocab_size
    costly = Constraint.grammar('start: "a" | "b" ("' + "e" * 1000 + '")~99')
    grammars = Grammars(tok, vocab, GrammarLimits(max_spelled=10**6, step_seconds=0.5))
    try:
        beside, alone = (grammars.compile(Constraint.json_schema(SCHEMA)).guide() for _ in range(2))
        text = tok.encode('{"kind":"file","name":"Ada Lovelace","owner":{"admin":true,"uid":7')  # keys sorted
        expected = follow(alone, text, vocab)
        follow(beside, text[:5], vocab)
        guide, process = grammars.compile(costly).guide(), grammars.guides.process
        follow(guide, [], vocab)
        with pytest.raises(GrammarError, match=r"^the grammar took over 0.5 s to take token [0-9]+ and compute the "
                                               r"allowed tokens after 0 tokens; at most 0.5 s a token$"):
            guide.accept(tok.encode("b")[0])
        assert process.poll() == -9 and grammars.guides.process is not process  # killed, and the next one started
        spare = grammars.guides.spare  # with a spare from then on, for the next such grammar
        assert spare is not None and spare.poll() is None
        assert torch.equal(follow(beside, text[5:], vocab), expected)
        with pytest.raises(GrammarError, match=r"^the grammar took over 0.5 s to take token"):
            grammars.compile(costly)  # refused by its text from then on: no sequence pays for it again
        # a process stopped, or killed from outside, is not the grammar's doing: the step is tried again on the next
        regex = Constraint.regex("[0-9]{3}")
        victim, later = grammars.compile(regex).guide(), grammars.compile(Constraint.json_schema(SCHEMA)).guide()
        follow(victim, [], vocab)
        follow(later, text[:3], vocab)
        grammars.guides.process.kill()
        grammars.guides.process.wait(60)  # dead before the next request (a dying process may still answer it)
        assert torch.equal(follow(victim, tok.encode("1"), vocab), follow(grammars.compile(regex).guide(),
                                                                          tok.encode("1"), vocab))
        assert grammars.guides.process is spare
        stop(grammars.guides.process.pid)  # 0.5 s with no CPU: the next process takes it
        assert torch.equal(follow(victim, tok.encode("2"), vocab), follow(grammars.compile(regex).guide(),
                                                                          tok.encode("12"), vocab))
        assert torch.equal(follow(later, text[3:], vocab), expected)
        stopped = grammars.guides.process
        stop(stopped.pid)  # between steps: a new sequence's open is tried again on the next
        assert torch.equal(follow(grammars.compile(regex).guide(), [], vocab), follow(alone_regex := grammars.compile(
            regex).guide(), [], vocab)) and stopped.poll() == -9 and alone_regex.tokens == 0
        # a crash in llguidance is the grammar's: a SIGABRT here, as Rust ends a thread that overflows its stack (a
        # SIGSEGV sent from outside is not one: Rust's guard-page handler returns from it)
        follow(victim, [], vocab)
        os.kill(grammars.guides.process.pid, signal.SIGABRT)
        grammars.guides.process.wait(60)
        with pytest.raises(GrammarError, match=r"^the regex '\[0-9\]\{3\}' crashed llguidance \(signal SIGABRT\) to "
                                               r"take token [0-9]+ and compute the allowed tokens after 2 tokens; "
                                               r"simplify it$"):
            victim.accept(tok.encode("3")[0])
        with pytest.raises(GrammarError, match=r"crashed llguidance \(signal SIGABRT\)"):
            grammars.compile(regex)
        # lost twice in a row for reasons of its own: the sequence ends, its grammar is not refused
        lost = Constraint.regex("[a-z]{3}")
        guide, call = grammars.compile(lost).guide(), grammars.guides.call

        def ends(request: dict, seconds: float) -> None:
            raise GuideLost("ended (signal SIGKILL)", False)

        grammars.guides.call = ends
        try:
            with pytest.raises(GrammarError, match=r"^the guide process ended \(signal SIGKILL\), twice, when asked to "
                                                   r"compute the allowed tokens after 0 tokens; the regex '\[a-z\]\{3\}' "
                                                   r"is not at fault: try again$"):
                guide.mask(torch.zeros(vocab))
        finally:
            grammars.guides.call = call
        follow(grammars.compile(lost).guide(), tok.encode("abc"), vocab)
    finally:
        grammars.close()


def test_a_grammar_slow_to_build_is_refused_at_its_compile(trained_model: GPT2) -> None:
    """The nineteenth attack: 300 patternProperties (14 KB, within every text limit) take llguidance over a second
    to build (its check that the patterns are disjoint), and each sequence new to the guide process builds it again
    while the engine thread waits; a new description each time escaped every cache. A build over
    GrammarLimits.build_seconds of CPU (0.1 s; 2,000 choices take 11 ms) is a 400 naming it; and what passes is built
    in the guide process as it is compiled, so that no sequence's open waits for a build."""
    patterns = {f"^{a}{b}{c}_[a-z]{{1,2}}$": {"type": "integer"} for a, b, c in itertools.islice(
        itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=3), 300)}
    # in CPU time as measured, or past four times that in wall time, where the compile process is stopped (~1.2 s here)
    with pytest.raises(GrammarError, match=r"^the JSON schema (takes [0-9.]+ s of CPU to build \(llguidance's compile "
                                           r"and first mask, done again for each process that follows it\); at most "
                                           r"0.1 s|took over 0.4 s to build \(llguidance's compile and first mask\); "
                                           r"at most 0.1 s of CPU)$"):
        trained_model.grammars.compile(Constraint.json_schema({"type": "object", "patternProperties": patterns}))
    compiled = trained_model.grammars.compile(Constraint.choice([f" word{i}" for i in range(2000)]))  # ~11 ms to build
    guide = compiled.guide()
    guide.mask(torch.zeros(trained_model.config.vocab_size))
    assert guide.built == 0.0 and guide.spent > 0  # its open copied what the compile had the guide process build
    # the twenty-first attack: a grammar the guide process no longer holds (dropped from its cache, or the process
    # replaced) while the compiled one is still cached here is built again by the next request's compile
    trained_model.grammars.guides.process.kill()
    trained_model.grammars.guides.process.wait(60)
    assert trained_model.grammars.compile(compiled.constraint) is compiled
    guide = compiled.guide()
    guide.mask(torch.zeros(trained_model.config.vocab_size))
    assert guide.built == 0.0


def test_a_build_waits_for_the_engine_step_that_holds_the_guide_process(trained_model: GPT2) -> None:
    """The twenty-first and twenty-second attacks: builds (request threads) taken between the round trips of one
    step's sequences added up to 0.6-1 s. A step holds the guide process for all its sequences' tokens (the scheduler's
    update: Guide.step), and a build waits until no step is waiting: the step waits for one build at most."""
    tok, vocab = trained_model.tokenizer, trained_model.config.vocab_size
    grammars = Grammars(tok, vocab)
    try:
        guides, calls = grammars.guides, []
        call = guides.call

        def logged(request: dict, seconds: float) -> tuple:  # each round trip once it is done
            answer = call(request, seconds)
            calls.append(request["op"])
            return answer

        guide = grammars.compile(Constraint.regex("[0-9]{4}")).guide()
        guides.call = logged
        with guides.step():
            compiling = threading.Thread(target=grammars.compile, args=(Constraint.regex("[a-z]{4}"),))
            compiling.start()
            for token in tok.encode("1234"):
                guide.mask(torch.zeros(vocab))
                guide.accept(token)
            compiling.join(2)  # its compile takes milliseconds; its build waits for this step
            assert compiling.is_alive()
            calls.append("step done")
        compiling.join()
        assert calls == ["open"] + ["accept"] * len(tok.encode("1234")) + ["step done", "build"], calls
    finally:
        grammars.close()


def test_the_servers_compiles_run_on_the_grammars_own_threads(trained_model: GPT2) -> None:
    """The twenty-second attack: 40 concurrent requests with fresh near-limit grammars filled asyncio's shared thread
    pool (their compiles wait for each other), and a plain chat request, whose template runs in that pool, waited
    2-3 s behind them. The server compiles on the grammars' own threads (Grammars.executor)."""
    grammars, names = trained_model.grammars, []
    compile = grammars.compile

    def recorded(constraint: Constraint):
        names.append(threading.current_thread().name)
        return compile(constraint)

    grammars.compile = recorded
    try:
        with live(trained_model) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0,
                                                "structured_outputs": {"regex": "[0-9]{2}"}})
            assert r.status_code == 200 and r.json()["choices"][0]["text"].isdigit(), r.text
    finally:
        del grammars.compile
    assert names and all(n.startswith("gpt2-grammar") for n in names), names


def test_llguidance_never_runs_in_the_engine_process(trained_dir: Path) -> None:
    """Every compile and every mask is computed in the two grammar processes: a crash of llguidance can never take
    the engine down."""
    code = ("import sys; from gpt2_engine import GPT2, Constraint; m = GPT2.from_pretrained(sys.argv[1]); "
            "out = m.complete(['Return the'], max_new_tokens=12, temperature=0, "
            "constraint=Constraint.json_schema({'type': 'object'})); "
            "print(out[0].text, 'llguidance' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(trained_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.rstrip().endswith(" False"), done.stderr[-2000:]
    assert done.stdout.startswith("{"), done.stdout


def test_a_grammar_costlier_than_a_token_budget_is_refused_at_its_probe_or_on_its_way(trained_model: GPT2) -> None:
    """The twelfth attack: `e{9990}` (a literal of 9,990 characters, spelled in 7) costs llguidance ~27 ms of CPU a
    token, 5-200x a concurrent greedy request's time. The compile's probe refuses a grammar whose median token costs
    over GrammarLimits.token_seconds; one whose probe path is cheap (the lowest ids: "a") but whose sequence takes a
    costly one ("b" then 2,900 e's, ~2.5 ms a token) is ended on its way, once its average passes the budget, and
    refused from then on."""
    tok, vocab = trained_model.tokenizer, trained_model.config.vocab_size
    grammars = Grammars(tok, vocab)
    try:
        with pytest.raises(GrammarError, match=r"^the regex 'e\{9990\}': costs [0-9.]+ ms of CPU a token to follow "
                                               r"\(the median of its first 16\); at most 1 ms$"):
            grammars.compile(Constraint.regex("e{9990}"))
        assert grammars.compile(Constraint.regex("e{200}")).cost < 0.001  # a literal of 200: ~50 us a token
        compiled = grammars.compile(Constraint.regex("a|be{2900}"))
        guide, logits = compiled.guide(), torch.zeros(vocab)
        with pytest.raises(GrammarError, match=r"^the regex 'a\|be\{2900\}' took [0-9]+ ms of CPU over [0-9]+ tokens; "
                                               r"at most 1 ms a token on average$"):
            for token in tok.encode("b") + tok.encode("e") * 100:
                guide.mask(logits)
                guide.accept(token)
        assert guide.tokens < 100
        with pytest.raises(GrammarError, match=r"took [0-9]+ ms of CPU over"):
            grammars.compile(Constraint.regex("a|be{2900}"))
        beside = compiled.guide()  # a sequence of the same request: refused before it pays for a step
        t0 = time.thread_time()
        with pytest.raises(GrammarError, match=r"took [0-9]+ ms of CPU over"):
            beside.mask(logits)
        assert beside.spent == 0.0 and time.thread_time() - t0 < 0.001
    finally:
        grammars.close()


@pytest.mark.parametrize("grammar, spelled", [
    ('start: "a" | "b" ("E")~99', 99_001),  # the thirteenth attack's (a 6 s step once "b" was taken)
    ('start: "a" | "b" x~20\nx: "E"', 20_001),  # a rule repeated
    ('start: "a" | "b" ((("E")~5)~4)', 20_001),  # repetitions nested
    ('start: "a" | "b" ' + '"E" ' * 20, 20_001),  # literals side by side, no repetition at all (0.2 s a step)
    ('start: "a" | "b" ' + "/E/ " * 20, 20_001),  # a regex that is a plain string joins them too
    ('start: "a" | "b" ' + " ".join(f"x{i}" for i in range(20)) + "".join(f'\nx{i}: "E"' for i in range(20)), 20_001),
    ('root ::= "a" | "b" ("E"){20}', 20_001),  # GBNF's count
    ('start: "a" | "b" ' + "/e{1000}/ " * 30, 30_001),  # regexes that are fixed strings (99 of them: 5 s a step)
    ('start: "a" | "b" /((e{10}){10}){200}/ "E"', 21_001),  # a regex's counts, nested
    ('start: "a" | "b" [' + '"E" ' * 5 + ']\nx: "::="', 5_000),  # Lark as llguidance tells it ([...] optional)
    # the fourteenth attack's (5.6 s a step each): a GBNF name with a dash, a rule with attributes, a terminal regex
    ('root ::= "a" | "b" -e{99}\n-e ::= "E"', 99_001),
    ('start: "a" | "b" e~99\ne[capture]: "E"', 99_001),
    ('start: "a" | "b" E~99\nE: /e{1000}/', 99_001),
    ('start: "a" | "b" y~20\ny: "E" | "E"', 20_001),  # alternatives that are one string (0.21 s a step)
    ('start: "a" | "b" ("E")~10..20', 10_001),  # a range's first ten are joined (54 ms)
    ('root ::= "a" | "b" ("E"){10,20}', 10_001),
    ('start: "a" | "b" ' + '"E" ' * 10 + 'z\nz: "E" | "x"', 10_001),  # the run ends at a rule of two strings
    ('start: "a" | "b" ("' + "\U0001F600" * 1000 + '")~4', 16_001),  # UTF-8 bytes, what the lexer reads
    ('start: "a" | "b" ("E" -> q)~20', 20_001),  # an alias is a tree node's name (0.21 s a step)
    ('start: "a" | "b" x~20\nx[lazy]: "E"', 20_001),  # attributes on the rule's head
    # the fifteenth attack's (5.2-5.5 s a step each): spellings llguidance reads as the same fixed string
    ('root ::= "a" | "b" x{99}\rx ::= "E"\r', 99_001),  # a bare CR ends a line, and a comment
    ('root ::= "a" | "b" x{99} # c\rx ::= "E"\n', 99_001),
    ('start: "a" | "b" E~99\nE: /\\x{65}{1000}/', 99_001),  # escapes of one character
    ('start: "a" | "b" E~99\nE: /\\u{65}{1000}/', 99_001),
    ('start: "a" | "b" E~99\nE: /e{1000}?/', 99_001),  # a lazy count is the same count
    ('start: "a" | "b" E~99\nE: /(?x)e{1 0 0 0}/', 99_001),  # verbose: spaces are not the regex's
    ('start: "a" | "b" E~99\nE: /e{1 0 0 0}/x', 99_001),
    ('start: "a" | "b" E~99\nE: /[e]{1000}/', 99_001),  # a class of one character is that character
    ('start: "a" | "b" E~99\nE: /[e-e]{1000}/', 99_001),
    ('root ::= "a" | "b" x{99}\nx ::= [e]{1000}', 99_001),
    ('start: "a" | "b" E~99\nE: ("e".."e")~1000', 99_001),  # a range of one character
    ('start: "a" | "b" E~99\nE: /e{1000}{1}/', 99_001),  # counts of counts multiply
    ('start: "a" | "b" e~99\ne [capture]: "E"', 99_001),  # heads as llguidance reads them
    ('start: "a" | "b" e~99\ne[stop="]"]: "E"', 99_001),
    ('?start: "a" | "b" ("E")~99', 99_001),  # Lark's own docs begin a grammar so
    # the sixteenth attack's (5.3-5.6 s a step each)
    ('start: "a" | "b" X{99}\nX: "E"', 99_001),  # llguidance's Lark takes {N} as its GBNF converter writes it
    ('start: "a" | "b" X{99,200}\nX: "E"', 99_001),
    ('root ::= "a" | "b" x{#c\n99}\nx ::= "E"', 99_001),  # a comment inside a count
    ('root ::= "a" | "b" x{99}\nx ::= "E"\nc ::= [\rstart:]', 99_001),  # a CR does not make GBNF Lark
    ('start: "a" | "b" X~99\nX: /[ee]{1000}/', 99_001),  # classes of one character however written
    ('start: "a" | "b" X~99\nX: /[e&&e]{1000}/', 99_001),
    ('start: "a" | "b" X~99\nX: /[[e]]{1000}/', 99_001),
    ('start: "a" | "b" X~99\nX: /[e-f--f]{1000}/', 99_001),
    ('start: "a" | "b" X~99\nX: /[\\x65e]{1000}/', 99_001),
    ('start: "a" | "b" X~99\nX: ("e" | "\\x65")~1000', 99_001),  # one string, escaped or not
    ('start: "a" | "b" X~99 | %lark {\nX: "E"\n}\nX: "z"', 99_001),  # a name defined twice: the longer counts
    ('start: "a" | "b" (LF~1000)~99\n%import common.LF', 99_001),  # Lark's common LF is "\n"
    # the seventeenth attack's (4.9-5.5 s a step each): Lark's tokens as llguidance's lexer reads them
    ('start: "a" | "b" X~+99\nX: "E"', 99_001),  # a count with a sign
    ('start: "a" | "b" X{+99}\nX: "E"', 99_001),
    ('start: "a" | "b" e-x~99\ne-x: "E"', 99_001),  # a dash inside a name
    ('start: "a" | "b" (Xy)~50\nX: "E"\ny: "E"', 100_001),  # two names with no space between them
    ('start: "a" | "b" e~99\n!?e: "E"', 99_001),  # a head with both prefixes
])
def test_a_grammar_that_joins_a_long_literal_is_refused_before_it_compiles(grammar: str, spelled: int) -> None:
    """The thirteenth and fourteenth attacks: llguidance joins a run of fixed strings into one lexeme, whose cost is
    about the square of its length at every token and spends none of its lexer fuel (grammar_text.py's doc), behind
    a branch the probe never takes. Each form is refused from its text, with the length llguidance would build."""
    text = grammar.replace("E", "e" * 1000)
    with pytest.raises(GrammarError, match=rf"^the grammar makes a literal of {spelled:,} bytes \(fixed strings "
                                           r"side by side or repeated, which llguidance joins into one lexeme that costs "
                                           r"the square of its length at every token\); at most 4,000$"):
        GrammarLimits().check(Constraint.grammar(text))


LLAMA_CPP_ARRAY = r"""char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})
item ::= "\"" char{0,1000} "\"" space
root ::= "[" space (item ("," space item){0,9})? "]" space
space ::= | " " | "\n" [ \t]{0,20}"""


LARK_DOCS_JSON = r"""?start: value
?value: object | array | string | SIGNED_NUMBER -> number | "true" -> true | "false" -> false | "null" -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS"""


@pytest.mark.parametrize("grammar, longest", [
    ('start: "a" | "b" ("E")~3', 3_001),
    ("start: " + " | ".join(f'"k{i}"' for i in range(1500)), 5),  # alternatives are not joined
    ('start: "a" ("E" /[0-9]/)~30', 1_000),  # a class ends the run (0.9 ms a step)
    ('start: "a" | "b" ("E" ("x" | "y"))~20', 1_000),  # as does an alternation of different strings
    ('start: "a" | "b" ("E" "x"?)~20', 1_000),  # an optional part
    ('start: "a" | "b" ("E")+', 1_000),  # an unbounded repetition (not inlined)
    ('start: "x" start | "y"', 1),  # recursion is not inlined
    (r'start: /[0-9]{1,10}/ /\d\d\d/ /(ab|cde){3}x*/ /[a-z]+/', 3),  # "cde", a run inside an alternation
    # the fourteenth attack's legitimate grammars, refused when everything in an alternative was counted
    (LLAMA_CPP_ARRAY, 1),  # llama.cpp's JSON-schema-to-GBNF form of an array of strings of maxLength 1,000
    ('root ::= date ("," date){0,364}\ndate ::= [0-9]{4} "-" [0-9]{2} "-" [0-9]{2}', 1),
    ('start: UUID ("," UUID)~99\nUUID: /[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/', 1),
    ("start: " + " ".join(f'"Field {i} of the quarterly report: " NUM "\\n"' for i in range(80)) +
     "\nNUM: /[0-9]+/", 35),  # a form: "\n" (one byte) and the next field's label between its values
    (LARK_DOCS_JSON, 5),  # the fifteenth attack's: `?start:` was read as GBNF and failed to convert
])
def test_legitimate_grammars_make_the_literals_they_say(grammar: str, longest: int) -> None:
    """What ends a run of fixed strings, each measured (grammar_text.py's doc): a grammar of many short strings, or
    of long ones between classes, alternations and optional parts, is read as what llguidance builds."""
    text = grammar.replace("E", "e" * 1000) if "ESCAPED" not in grammar else grammar
    assert longest_literal(text) == longest
    GrammarLimits().check(Constraint.grammar(text))
    with pytest.raises(GrammarError, match=r"^the grammar: its parentheses nest over 100 levels$"):
        GrammarLimits().check(Constraint.grammar("start: " + "(" * 101 + '"a"' + ")" * 101))
    with pytest.raises(GrammarError, match=r"^the grammar: an item carries over 8 counts or quantifiers$"):
        GrammarLimits().check(Constraint.grammar('start: "a"' + "~2" * 20_000))  # each count was a tuple copied


def test_what_a_json_schema_never_generates_is_not_a_literal_and_short_texts_are_judged_whole(
        trained_model: GPT2) -> None:
    """The thirteenth attack's legitimate requests: a tool's 1,260-character description (and title, $comment,
    examples) counted as a literal and was refused, as was a choice of 1,000-1,999 short strings, whose probe took
    only 2 tokens at ~1.5 ms (the median was judged against 1 ms a token; the runtime allows 16 tokens' worth more).
    A property named "description" is still a name the model writes."""
    long = "x" * 1500
    limits = GrammarLimits()
    limits.check(Constraint.json_schema({"type": "object", "title": long, "description": long, "$comment": long,
                                         "properties": {"q": {"type": "string", "description": long,
                                                              "examples": [long], "default": long}}}))
    for schema in ({"properties": {long: {"type": "string"}}}, {"properties": {"description": {"const": long}}},
                   {"$defs": {"title": {"enum": [long]}}}):
        with pytest.raises(GrammarError, match="has a literal of 1,500 characters; at most 1,000"):
            limits.check(Constraint.json_schema(schema))
    # a pattern's fixed text costs as a literal does (0.3 s for this one before llguidance's fuel ends it)
    with pytest.raises(GrammarError, match=r"^the JSON schema has a pattern with 30,001 bytes of fixed text in a "
                                           r"row \(llguidance makes it one literal, which costs the square of its "
                                           r"length at every token\); at most 4,000$"):
        limits.check(Constraint.json_schema({"anyOf": [{"const": "a"},
                                                       {"type": "string", "pattern": "^b(e{1000}){30}$"}]}))
    with pytest.raises(GrammarError, match=r"^the JSON schema has a pattern with 30,001 bytes of fixed text"):
        limits.check(Constraint.json_schema({"type": "object", "patternProperties": {"^b(e{1000}){30}$": {}}}))
    limits.check(Constraint.json_schema({"type": "string", "pattern": r"^.{0,4000}$|^\d{4}-\d{2}-\d{2}$"}))
    grammars = Grammars(trained_model.tokenizer, trained_model.config.vocab_size)
    try:
        # 2,000 (MAX_CHOICES) sharing "c": one Earley item more than llguidance's row limit once "c" is taken
        for choices in ([f"c{i}" for i in range(2000)], [f" word{i}" for i in range(2000)]):
            compiled = grammars.compile(Constraint.choice(choices))
            guide = compiled.guide()
            for token in trained_model.tokenizer.encode(choices[-1]):
                guide.mask(torch.zeros(trained_model.config.vocab_size))
                guide.accept(token)
            assert guide.finished
        grammars.compile(Constraint.grammar("start: " + " | ".join(f'"k{i}"' for i in range(1500))))
        # the fifteenth attack's: Lark's documented JSON grammar (`?start:`), a pattern of 1,400 characters
        grammars.compile(Constraint.grammar(LARK_DOCS_JSON))
        countries = "^(" + "|".join(f"Country{i:03d}" for i in range(140)) + ")$"
        assert len(countries) > 1_400
        grammars.compile(Constraint.json_schema({"type": "string", "pattern": countries}))
    finally:
        grammars.close()
    with pytest.raises(GenerationError, match=r"^choice: over 2,000 choices; expected at most 2,000$"):
        Constraint.choice(str(i) for i in itertools.count())  # an endless iterable is read no further than that


def test_hostile_grammars_do_not_stall_concurrent_greedy_requests(server: str) -> None:
    """Item 2: a ~100-byte regex made a concurrent greedy request take 36 s instead of about 1 s. Greedy requests run
    one after another for as long as the hostile ones are sent; each hostile request ends within its limits (a 400
    naming the limit, or a normal answer), and no greedy request takes more than 3x its time alone + 2 s. The bound
    is loose on purpose: a hostile request may take the engine thread for one step of up to the step budget (1 s),
    and it shares this small machine's cores (its compile process, its compile in the server), whose load from other
    work changes from minute to minute (hence "alone" measured before and after); a stall took 36-80 s."""
    greedy = {"prompt": "Return the", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    hostile = [  # the issue's requests
        ({"regex": "a{100000}"}, 400, "over llguidance's lexer fuel"),
        # its build runs out of lexer fuel after ~0.15 s of CPU, or past 0.4 s of wall time on a loaded machine
        ({"regex": "(a{1000}){1000}"}, 400, ("over llguidance's lexer fuel", "took over 0.4 s to build")),
        ({"regex": "((((a|b){20}){20}){20}){20}"}, 200, '"finish_reason":"length"'),
        ({"json": {"enum": ["x" * 100_000, "y" * 100_000]}}, 400, "is 200,018 bytes; at most 100,000"),
        ({"json": {"enum": ["y" * 40_000, "x" * 40_000]}}, 400, "has a literal of 40,000 characters; at most 1,000"),
        # the twelfth attack's: 96 bytes within the text limits, 27 ms a token (a concurrent greedy request took 12x)
        ({"regex": "e{9990}"}, 400, "ms of CPU a token to follow (the median of its first 16); at most 1 ms"),
        # the thirteenth's: 1.2 KB whose cheap branch ("a") passed the probe; "b" then cost 6 s of one step
        ({"grammar": 'start: "a" | "b" ("' + "e" * 1000 + '")~99'}, 400, "makes a literal of 99,001 bytes"),
    ]
    with httpx.Client(base_url=server, timeout=120) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        def timed() -> float:
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json=greedy)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
            return time.perf_counter() - t0

        before = statistics.median(timed() for _ in range(3))
        stop, seconds = [], []

        def keep_sending() -> None:
            while not stop and len(seconds) < 500:
                seconds.append(timed())

        background = pool.submit(keep_sending)
        took = {}
        try:
            with httpx.Client(base_url=server, timeout=120) as h:
                for so, status, fragments in hostile:
                    t0 = time.perf_counter()
                    r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "temperature": 1.0, "seed": 1,
                                                        "structured_outputs": so})
                    took[json.dumps(so)[:40]] = round(time.perf_counter() - t0, 3)
                    fragments = (fragments,) if isinstance(fragments, str) else fragments
                    assert r.status_code == status and any(f in r.text for f in fragments), (so, r.text[:300])
                    if status == 400:
                        error = r.json()["error"]
                        assert error["param"] == "structured_outputs" and "\n" not in error["message"]
        finally:
            stop.append(True)  # a failure above stops the greedy requests too
        background.result()
        alone = max(before, statistics.median(timed() for _ in range(3)))
    print(f"greedy alone {alone:.3f} s; while hostile requests ran: {[round(x, 3) for x in seconds]}; "
          f"the hostile requests took {took}")
    assert seconds and max(seconds) < 3 * alone + 2, (alone, seconds)


def test_a_schema_may_hold_numpy_and_torch_numbers_and_nothing_else_that_is_not_json() -> None:
    """The thirteenth attack: {"maximum": np.int64(3)} was refused as not JSON while np.float64 (a float) passed."""
    import numpy as np

    assert json.loads(Constraint.json_schema({"type": "integer", "maximum": np.int64(3), "minimum": torch.tensor(1),
                                              "multipleOf": np.float32(0.5)}).spec) == {
        "type": "integer", "maximum": 3, "minimum": 1, "multipleOf": 0.5}
    assert json.loads(Constraint.json_schema({"const": np.bool_(False)}).spec) == {"const": False}
    for bad, name in (({"enum": {1, 2}}, "set"), ({"const": b"x"}, "bytes")):
        with pytest.raises(GenerationError, match=rf"^the JSON schema must hold only JSON values \(.*\): Object of "
                                                  rf"type {name}_? is not JSON serializable$"):
            Constraint.json_schema(bad)
    # the fourteenth attack: {"const": NaN} (Python's json reads and writes NaN) generated null, with a 200
    for bad in ({"const": float("nan")}, '{"const": NaN}', {"maximum": -float("inf")}, {"enum": [np.float64("nan")]}):
        with pytest.raises(GenerationError, match=r"^the JSON schema holds NaN or Infinity, which are not JSON numbers "
                                                  r"\(llguidance would read them as null\); expected finite numbers$"):
            Constraint.json_schema(bad)


def test_json_is_compact_by_default_and_whitespace_flexible_on_request(trained_model: GPT2) -> None:
    """Item 7: after "{" compact JSON allows no space or newline; whitespace_flexible (llguidance's option, vLLM's
    disable_any_whitespace inverted) allows both."""
    tok, vocab = trained_model.tokenizer, trained_model.config.vocab_size
    for constraint in (Constraint.json_object(), Constraint.json_schema(SCHEMA)):
        for flexible in (False, True):
            guide = trained_model.grammars.compile(
                Constraint(constraint.kind, constraint.spec, whitespace_flexible=flexible)).guide()
            guide.mask(torch.zeros(vocab))
            guide.accept(tok.encode("{")[0])
            allowed = guide.mask(torch.zeros(vocab)) > -torch.inf
            assert [bool(allowed[tok.encode(w)[0]]) for w in (" ", "\n", "\t")] == [flexible] * 3, constraint.kind
    with pytest.raises(GenerationError, match="whitespace_flexible applies to JSON"):
        Constraint("regex", "a", whitespace_flexible=True)


def test_a_small_model_finishes_schema_constrained_json_at_temperature_1(trained_model: GPT2) -> None:
    """Item 7, on the trained fixture: at temperature 1, completions held to the schema finish well within 96 tokens
    (compact JSON of it takes at most about 65 here), with no whitespace outside their strings."""
    outs = trained_model.complete(["Return the"], max_new_tokens=96, temperature=1.0, top_k=0, seed=11,
                                  num_samples=20, constraint=Constraint.json_schema(SCHEMA))
    done = [o for o in outs if o.finish_reason in ("stop", "eos")]
    assert len(done) >= 18, [o.text for o in outs if o not in done]
    for o in done:
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert not re.search(r"\s", outside_strings(o.text)), o.text


@pytest.mark.slow
def test_flexible_whitespace_never_finishes_where_compact_json_always_does(tiny_model: GPT2) -> None:
    """Item 7's failure: random weights sample near-uniformly among the allowed tokens, and GPT-2 has many tokens of
    whitespace, so with flexible whitespace 0 of 20 completions finish in 96 tokens (the issue's count on its
    checkpoint); compact JSON of this schema (enums, bounded integers) is at most about 45 tokens, so all finish."""
    finished = {}
    for flexible in (False, True):
        outs = tiny_model.complete(["Return the"], max_new_tokens=96, temperature=1.0, top_k=0, seed=11,
                                   num_samples=20, constraint=Constraint.json_schema(BOUNDED, whitespace_flexible=flexible))
        finished[flexible] = sum(o.finish_reason in ("stop", "eos") for o in outs)
        if not flexible:
            for o in outs:
                jsonschema.validate(json.loads(o.text), BOUNDED)
                assert len(o.token_ids) <= 60 and not re.search(r"\s", outside_strings(o.text)), o.text
    assert finished[False] == 20 and finished[True] <= 2, finished


def test_whitespace_flexible_through_gpt2_serve(client) -> None:
    """The opt-in in OpenAI's response_format and in vLLM's structured_outputs: with the space and newline tokens
    pushed up by logit_bias, flexible JSON takes them between its tokens and compact JSON only inside strings."""
    bias = {"220": 100, "198": 100}  # " ", "\n"
    for flexible in (False, True):
        for extra in ({"response_format": {"type": "json_object", "whitespace_flexible": flexible}},
                      {"structured_outputs": {"json": SCHEMA, "whitespace_flexible": flexible}}):
            text = client.completions.create(model="gpt2", prompt="Return the", max_tokens=8, temperature=0,
                                             logit_bias=bias, extra_body=extra).choices[0].text
            outside = outside_strings(text).partition('"')[0]  # up to a string still open at max_tokens
            assert (text.startswith("{") or flexible) and bool(re.search(r"\s", outside)) == flexible, (extra, text)

"""Structured output on llguidance: JSON schemas, regexes, choices and grammars hold on every sample, through the
Python API, `gpt2 generate` and a real `gpt2 serve` with the `openai` client; the mask sits before the sampler's
filters, constrained and free rows share passes exactly, and speculative decoding stays exact under a grammar."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from test_serve import live

from gpt2_engine import GPT2, Constraint, GenerationError

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
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{2})?"
CHOICES = ["file", "directory", "link", "socket"]


def test_constraints_are_checked_with_one_line_errors(trained_model: GPT2) -> None:
    bad = [(lambda: Constraint.choice([]), "choice must be a non-empty list of non-empty strings"),
           (lambda: Constraint.choice("ab"), "choice must be a non-empty list"),
           (lambda: Constraint.json_schema("{not json"), "the JSON schema is not valid JSON"),
           (lambda: Constraint("xml"), "constraint kind must be one of json_schema, json_object, regex, choice, grammar"),
           (lambda: trained_model.generate("x", constraint=Constraint.regex("[0-9")), "the regex '[0-9': "),
           (lambda: trained_model.generate("x", constraint=Constraint.json_schema({"type": "objekt"})),
            "the JSON schema: Invalid type: objekt"),
           (lambda: trained_model.generate("x", constraint=Constraint.choice(["a"]), ignore_eos=True),
            "ignore_eos cannot be combined with a constraint"),
           (lambda: trained_model.generate("x", constraint={"regex": "a"}), "constraint must be a Constraint")]
    for call, message in bad:
        with pytest.raises(GenerationError, match=re.escape(message)) as e:
            call()
        assert "\n" not in str(e.value)


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
    for args, message in [(("--regex", "a", "--choice", "b"), "give one structured-output flag, not --regex and --choice"),
                          (("--json-schema", str(tmp_path / "missing.json")), "--json-schema"),
                          (("--regex", "[0-9"), "the regex '[0-9': ")]:
        bad = gpt2(*args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and message in bad.stderr, bad.stderr


@pytest.fixture(scope="module")
def server(trained_server: str) -> str:
    return trained_server  # the session's one server (conftest.py)


@pytest.fixture(scope="module")
def client(server: str):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


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
])
def test_bad_constraints_are_400s_naming_the_field(server: str, body: dict, param: str, fragment: str) -> None:
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


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

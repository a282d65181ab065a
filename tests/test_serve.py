"""`gpt2 serve`: the real server on 127.0.0.1 driven by the `openai` client, errors in OpenAI's shape, back-pressure,
cancellation, and outputs that do not depend on what else is running."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gzip
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from conftest import SERVER_START, THREADS, free_port, healthy, wait_for

from gpt2_engine import GPT2
from gpt2_engine.cli import main
from gpt2_engine.serve.app import ServerSettings, ServerState, build_app, http_protocol
from gpt2_engine.serve.async_engine import AsyncEngine, EngineSettings, start_engine
from gpt2_engine.serve.metrics import parse

openai = pytest.importorskip("openai", reason="the openai client is part of the test extra")


@pytest.fixture(scope="module")
def server(trained_server: str) -> str:
    return trained_server  # the session's one server (conftest.py)


@pytest.fixture(scope="module")
def client(server: str):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_completion_equals_gpt2_generate(client, trained_model: GPT2) -> None:
    for prompt in ["Return the number of", "The default value of", "Zoë — 東京"]:
        out = client.completions.create(model="gpt2", prompt=prompt, max_tokens=24, temperature=0)
        expected = trained_model.complete([prompt], max_new_tokens=24, temperature=0)[0]
        assert out.choices[0].text == expected.text
        assert out.usage.prompt_tokens == len(trained_model.tokenizer.encode(prompt))
        assert out.usage.completion_tokens == len(expected.token_ids)
        assert out.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
        assert out.object == "text_completion" and out.model == "gpt2" and out.id.startswith("cmpl-")


def test_streamed_chunks_join_to_the_whole_text(client) -> None:
    kwargs = dict(model="gpt2", prompt="If the argument is", max_tokens=30, temperature=0.9, seed=5)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_n_with_a_seed_is_reproducible(client) -> None:
    kwargs = dict(model="gpt2", prompt="Return a new", max_tokens=20, temperature=1.0, n=3, seed=11)
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1  # each choice draws with its own seed


def test_prompt_forms(client, trained_model: GPT2) -> None:
    ids = trained_model.tokenizer.encode("The file")
    by_text = client.completions.create(model="gpt2", prompt="The file", max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="gpt2", prompt=ids, max_tokens=8, temperature=0)
    many = client.completions.create(model="gpt2", prompt=["The file", "Return"], max_tokens=8, temperature=0)
    many_ids = client.completions.create(model="gpt2", prompt=[ids, [464]], max_tokens=8, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text == many.choices[0].text == many_ids.choices[0].text
    assert many.choices[1].text == client.completions.create(model="gpt2", prompt="Return", max_tokens=8,
                                                             temperature=0).choices[0].text
    assert many.usage.prompt_tokens == len(ids) + 1


def test_stop_and_logit_bias(client, trained_model: GPT2) -> None:
    token = trained_model.tokenizer.encode(" file")[0]
    out = client.completions.create(model="gpt2", prompt="The", max_tokens=5, temperature=0,
                                    logit_bias={str(token): 100})
    assert out.choices[0].text == " file" * 5
    stopped = client.completions.create(model="gpt2", prompt="The", max_tokens=5, temperature=0,
                                        logit_bias={str(token): 100}, stop=["e fi"])
    assert stopped.choices[0].text == " fil" and stopped.choices[0].finish_reason == "stop"  # cut before the stop


def test_echo_logprobs_score_the_prompt_like_gpt2_score(client, trained_dir: Path, tmp_path: Path, capsys) -> None:
    text = "The default value of the argument is returned."
    out = client.completions.create(model="gpt2", prompt=text, max_tokens=0, echo=True, logprobs=3)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == text and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
    assert all(len(t) == 3 for t in lp.top_logprobs[1:])
    (tmp_path / "doc.txt").write_text(text, encoding="utf-8")
    assert main(["score", str(tmp_path / "doc.txt"), "--no-bos", "--per-token", str(tmp_path / "t.jsonl"),
                 "--weights", str(trained_dir)]) == 0
    capsys.readouterr()
    scored = [json.loads(line)["logprob"] for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert lp.token_logprobs[1:] == pytest.approx(scored, abs=1e-5)
    assert out.usage.completion_tokens == 0


def test_logprobs_of_generated_tokens(client) -> None:
    out = client.completions.create(model="gpt2", prompt="The", max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.token_logprobs) == 6
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        # greedy: the chosen token is the most likely one, unless the most likely is the end-of-text ignore_eos bans
        assert max(top.values()) == logprob or max(top, key=top.get) == "<|endoftext|>"  # the same float32 number
        assert max(top.values()) >= logprob - 1e-6


def test_models_tokenize_detokenize(server: str, trained_model: GPT2) -> None:
    with httpx.Client(base_url=server, timeout=30) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["gpt2"]
        tokens = c.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
        assert tokens == trained_model.tokenizer.encode("Hello world")
        assert c.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "Hello world"}
        for ids, given in (([True], "true"), ([2.0], "2.0"), (["1"], '"1"')):  # JSON's true is not token 1
            r = c.post("/detokenize", json={"tokens": ids})
            assert r.status_code == 400 and r.json()["error"] == {
                "message": f"tokens.0: expected an integer, got {given}", "type": "invalid_request_error",
                "param": "tokens", "code": None}, r.text


@pytest.mark.parametrize("body,status,param,fragment", [
    ({"prompt": "x", "temperature": 5}, 400, "temperature", "temperature must be in [0, 2]"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "must be a number in [-2, 2]"),
    ({"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias", "numbers in [-100, 100]"),
    ({"prompt": "x", "logit_bias": {"60000": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ({"prompt": [[1], []]}, 400, "prompt", "a token-id prompt must not be empty"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 0"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 stop sequences"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix", "suffix is not supported"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of", "best_of other than n"),
    ({"prompt": [], "max_tokens": 1}, 400, "prompt", "must not be an empty list"),
    ({"prompt": [70000]}, 400, "prompt", "token ids must be in [0, 50257)"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", "keys must be token ids"),
    ({"prompt": "x", "logit_bias": {"²": 1}}, 400, "logit_bias", "keys must be token ids (decimal digits 0-9)"),
    ({"prompt": "x", "logit_bias": {"١٢": 1}}, 400, "logit_bias", "keys must be token ids (decimal digits 0-9)"),
    ({"prompt": "x", "repetition_penalty": 1e-300}, 400, "repetition_penalty", "must be in [0.01, 100]"),
    ({"prompt": "x " * 600, "max_tokens": 100}, 400, "prompt", "exceeds the context of 512 tokens"),
    ({"prompt": "x", "max_tokens": 3, "max_completion_tokens": 4}, 400, "max_completion_tokens",
     "max_tokens (3) and max_completion_tokens (4) disagree"),
    ({"prompt": "x", "max_tokens": 513}, 400, "max_tokens", "asking for 513 new tokens exceeds the context of 512"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"prompt": "x", "model": "m" * 100_000}, 404, "model", "'" + "m" * 200 + "'... (100,000 characters) does not"),
    ({"prompt": [True, False]}, 400, "prompt", "Input should be"),
    ({"prompt": "x", "n": True}, 400, "n", "n: expected an integer, got true"),
    ({"prompt": "x", "n": 2.0}, 400, "n", "n: expected an integer, got 2.0"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs", "logprobs: expected an integer, got true"),
])
def test_bad_requests_get_openai_shaped_errors(server: str, body: dict, status: int, param: str, fragment: str) -> None:
    body = {"model": "gpt2", **body}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and fragment in err["message"]
    assert err["type"] == "invalid_request_error"
    assert "max_new_tokens" not in err["message"] and "--" not in err["message"]  # the API's words, not the CLI's


@pytest.mark.parametrize("field,value,message", [
    # each was taken (as true, as seed 1, as a bias of 1), as OpenAI's server does not take them
    ("echo", "yes", 'echo: expected true or false, got "yes"'),
    ("stream", "yes", 'stream: expected true or false, got "yes"'),
    ("ignore_eos", "yes", 'ignore_eos: expected true or false, got "yes"'),
    ("ignore_eos", 1, "ignore_eos: expected true or false, got 1"),
    ("echo", 0, "echo: expected true or false, got 0"),
    ("seed", "1", 'seed: expected an integer, got "1"'),
    ("seed", True, "seed: expected an integer, got true"),
    ("seed", 1.0, "seed: expected an integer, got 1.0"),
    ("logit_bias", {"5": "1"}, 'logit_bias.5: expected a number, got "1"'),
    ("logit_bias", {"5": True}, "logit_bias.5: expected a number, got true"),
    ("temperature", "0.5", 'temperature: expected a number, got "0.5"'),
    ("max_tokens", "4", 'max_tokens: expected an integer, got "4"'),
    ("top_k", 2.5, "top_k: expected an integer, got 2.5"),
])
def test_fields_of_the_wrong_json_type_are_400s_naming_what_was_given(server: str, field: str, value: object,
                                                                       message: str) -> None:
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 1, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": field, "code": None}


def test_a_json_integer_is_a_number_and_null_a_missing_field(server: str) -> None:
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0, "top_p": 1, "logit_bias": {"11": 2}, "seed": None,
            "echo": False, "stream": False, "ignore_eos": True}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_a_completion_stops_at_the_context_with_finish_reason_length(server: str) -> None:
    r = httpx.post(f"{server}/v1/completions", json={"model": "gpt2", "prompt": "x " * 500, "max_tokens": 100,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == 512 - usage["prompt_tokens"] + 1 < 100  # up to the context's last position


def test_unknown_route_and_invalid_json(server: str) -> None:
    r = httpx.get(f"{server}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


UNREADABLE = ("the body could not be read as JSON (its text is not UTF-8, its values nest too deeply, or an integer "
              "has over 4,300 digits)")


@pytest.mark.parametrize("body, message", [
    (b"\xff\xfe\x00garbage", "the body is not valid JSON"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', UNREADABLE),
    (b"[" * 100_000, UNREADABLE),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, UNREADABLE),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", UNREADABLE),  # valid JSON past Python's digit limit
    (b"", "the body is empty: expected a JSON object"),
])
def test_an_unreadable_body_is_a_400_saying_why(server: str, body: bytes, message: str) -> None:
    r = httpx.post(f"{server}/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text


def metrics(server: str) -> dict[str, float]:
    return parse(httpx.get(f"{server}/metrics", timeout=10).text)


def test_concurrent_clients_get_exactly_their_alone_outputs(client, server: str) -> None:
    """16 streaming clients with mixed parameters, all at once, against each one alone."""
    params = [dict(prompt=p, max_tokens=12 + 3 * (i % 5), temperature=[0, 0.7, 1.0, 1.3][i % 4], seed=100 + i,
                   top_p=[1.0, 0.9][i % 2], stop=["."] if i % 3 == 0 else None)
              for i, p in enumerate(["The file", "Return the", "If the", "This module", "Raises an", "The default",
                                     "A new", "The number of"] * 2)]

    def run(kw: dict) -> str:
        return "".join(c.choices[0].text for c in client.completions.create(model="gpt2", stream=True, **kw)
                       if c.choices)

    alone = [run(kw) for kw in params]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, params))
    assert together == alone
    m = metrics(server)
    assert m["gpt2_requests_running"] == 0 and m["gpt2_requests_waiting"] == 0
    assert m["gpt2_time_to_first_token_seconds_count"] >= 32


def test_a_client_that_goes_away_frees_its_slot(server: str) -> None:
    body = {"model": "gpt2", "prompt": "The", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{server}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert metrics(server)["gpt2_requests_running"] == 1
        deadline = time.monotonic() + 10
        while metrics(server)["gpt2_requests_running"] != 0:  # freed within one engine step of the disconnect
            assert time.monotonic() < deadline, "the slot was not freed"
        assert metrics(server)['gpt2_requests_finished_total{reason="cancelled"}'] >= 1
        ok = c.post(f"{server}/v1/completions", json={"model": "gpt2", "prompt": "The", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# --- a server in a thread with small limits: back-pressure and the API key ----------------------------------------


@contextlib.contextmanager
def live(model: GPT2, *, parallel: int = 1, max_queue: int = 1, queue_timeout: float = 60,
         api_key: str | None = None, adapters: tuple[tuple[str, Path], ...] = (),
         speculate: str | None = None, prefix_cache_mb: float | None = None,
         settings: ServerSettings | None = None,
         header_seconds: float | None = None) -> Iterator[tuple[str, AsyncEngine]]:
    """The app on a real uvicorn server on 127.0.0.1, in a thread of this process, over `model` (and LoRA
    `adapters`, (model id, directory) pairs, as gpt2 serve --lora NAME=DIR serves them; `speculate`: --speculate;
    `prefix_cache_mb`: --prefix-cache-mb, None: --no-prefix-cache; `settings`: the server's, instead of these)."""
    engine = start_engine(model, EngineSettings(parallel, max_queue, queue_timeout, speculate,
                                                prefix_cache_mb=prefix_cache_mb),
                          [path for _, path in adapters])
    settings = settings or ServerSettings(api_key=api_key, adapters=adapters)
    state = ServerState(settings, model=model, engine=engine)
    http = "auto" if header_seconds is None else http_protocol(header_seconds)  # gpt2 serve's, with its own bound
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=free_port(), log_level="error",
                                           http=http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.stop()


LONG = {"model": "gpt2", "prompt": "The", "max_tokens": 400, "ignore_eos": True, "stream": True}


def test_an_idle_server_accepts_a_burst_of_slots_plus_queue(trained_model: GPT2) -> None:
    """parallel + max_queue streams at once are all accepted (free slots count), the next one is refused."""
    with live(trained_model, parallel=2, max_queue=2) as (url, engine), httpx.Client(base_url=url, timeout=60) as c, \
            contextlib.ExitStack() as streams:
        for _ in range(4):  # kept open: closing one would be a disconnect
            r = streams.enter_context(c.stream("POST", "/v1/completions", json=LONG))
            assert r.status_code == 200
        assert engine.held == 4
        refused = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        # more sequences than the server ever holds: no retry would help (it was a 429 saying "retry later")
        never = c.post("/v1/completions", json={"prompt": ["x"] * 3, "n": 2, "max_tokens": 1})
        assert never.status_code == 400 and never.json()["error"]["message"] == (
            "the request asks for 6 sequences (prompts x n); this server holds at most 4 at once (--parallel plus "
            "--max-queue)"), never.text


def test_a_full_queue_answers_429_with_retry_after(trained_model: GPT2) -> None:
    with live(trained_model, parallel=1, max_queue=1) as (url, engine), httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=LONG) as first:
            lines = first.iter_lines()  # kept alive: closing it would close the connection (a disconnect)
            next(line for line in lines if line.startswith("data:"))  # it holds the only slot
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                second = pool.submit(c.post, "/v1/completions", json={**LONG, "stream": False, "max_tokens": 2})
                wait_for(lambda: engine.queued == 1, "the second request to queue")  # 1 slot + 1 waiting: full
                third = c.post("/v1/completions", json={"model": "gpt2", "prompt": "x", "max_tokens": 1})
                assert third.status_code == 429 and third.headers["retry-after"] == "1"
                assert third.json()["error"]["type"] == "rate_limit_error" and third.json()["error"]["code"] == "queue_full"
        assert second.result().status_code == 200  # served once the first request's client went away
        assert c.get("/health").status_code == 200
        wait_for(lambda: engine.loop.scheduler.running == 0, "the slots to empty")
        m = parse(c.get("/metrics").text)
        assert m['gpt2_requests_rejected_total{reason="queue_full"}'] == 1 and m["gpt2_requests_running"] == 0


def test_a_request_that_waits_too_long_gets_503(trained_model: GPT2) -> None:
    with live(trained_model, parallel=1, max_queue=4, queue_timeout=0.05) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=LONG) as first:
            lines = first.iter_lines()  # kept alive: closing it would close the connection (a disconnect)
            next(line for line in lines if line.startswith("data:"))
            late = c.post("/v1/completions", json={"model": "gpt2", "prompt": "x", "max_tokens": 1})
            assert late.status_code == 503 and late.json()["error"]["code"] == "queue_timeout"
            assert late.headers["retry-after"] == "1"


def test_api_key_guards_every_route_but_health(trained_model: GPT2) -> None:
    with live(trained_model, parallel=2, max_queue=4, api_key="s3cret") as (url, _), \
            httpx.Client(base_url=url, timeout=60) as c:
        body = {"model": "gpt2", "prompt": "x", "max_tokens": 1}
        for path, method in [("/v1/completions", "POST"), ("/v1/models", "GET"), ("/metrics", "GET"),
                             ("/tokenize", "POST")]:
            r = c.request(method, path, json=body if method == "POST" else None)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        for header in ("bearer s3cret", "BEARER s3cret"):  # the scheme's case is free (RFC 7235), the key's is not
            assert c.post("/v1/completions", json=body, headers={"Authorization": header}).status_code == 200
        for header in ("Basic s3cret", "Bearer S3CRET", "s3cret", "Bearer", "Bearers3cret"):
            assert c.post("/v1/completions", json=body, headers={"Authorization": header}).status_code == 401, header


def test_a_body_over_the_limit_is_413(trained_model: GPT2) -> None:
    """By Content-Length, and as a chunked body streams in (FastAPI turned that one into a 400 about JSON)."""
    body = json.dumps({"model": "gpt2", "prompt": "x" * (2 << 20)}).encode()
    with live(trained_model) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        for content in (body, iter([body[i : i + 65536] for i in range(0, len(body), 65536)])):  # the second chunked
            r = c.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text


def test_a_body_that_stops_arriving_is_408_and_a_stream_is_not_cut(trained_model: GPT2) -> None:
    """A client that sent a byte of its body and stopped held its connection and buffers open for as long as it
    liked (19,950 such connections took the server from 490 to 930 MB): the next piece must come within
    body_seconds, and the whole body within 4 x body_seconds (a byte every 29 s held it for ever). The wait for a streaming client's disconnect, after its body, is not bounded."""
    import select
    import socket

    with live(trained_model, settings=ServerSettings(body_seconds=0.3)) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            reply = b""
            while b"}}" not in reply and (piece := s.recv(4096)):
                reply += piece
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), reply
        assert json.loads(body)["error"] == {"message": "the request body stopped arriving for 0.3 s",
                                             "type": "invalid_request_error", "param": None,
                                             "code": "request_timeout"}
        with socket.create_connection((host, int(port)), timeout=30) as s:  # a byte within every gap, for ever
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            for _ in range(50):  # 0.1 s apart: 5 s at most, where the whole body may take 4 x 0.3 s
                if select.select([s], [], [], 0.1)[0]:
                    break
                s.sendall(b" ")
            reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408 ") and b"the request body took over 1.2 s to arrive" in reply, reply
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "gpt2", "prompt": "The", "max_tokens": 120, "ignore_eos": True, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) == 121  # a chunk a token


def test_a_connection_whose_headers_never_end_is_closed_and_a_keep_alive_one_is_served(trained_model: GPT2) -> None:
    """uvicorn bounds only the idle time between keep-alive requests: connections that sent part of their headers
    and stopped were held as long as the client liked (20,000 took every file descriptor). gpt2 serve's protocol
    closes one whose headers are not in within the bound, on a new connection and on a kept-alive one alike."""
    import socket

    def closed_by_server(s: socket.socket) -> bool:
        return s.recv(4096) == b""  # the server's close, within the socket's own timeout

    with live(trained_model, header_seconds=0.3) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            assert closed_by_server(s)
        with socket.create_connection((host, int(port)), timeout=30) as s:  # a whole request, then half of another
            body = json.dumps({"model": "gpt2", "prompt": "The", "max_tokens": 1}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            reply = b""
            while b"}}" not in reply and b'"usage"' not in reply:
                reply += s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200 ")
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            rest = s.recv(4096)
            while rest:  # what is left of the first reply, then the close
                rest = s.recv(4096)
        with httpx.Client(base_url=url, timeout=30) as c:  # a client that finishes its headers is served
            assert c.get("/health").status_code == 200


def test_a_compressed_body_is_415(server: str) -> None:
    """A gzip body was read as JSON (a 400 "not valid JSON"); it is refused by its encoding, and never inflated."""
    body = gzip.compress(json.dumps({"model": "gpt2", "prompt": "x", "max_tokens": 1}).encode())
    r = httpx.post(f"{server}/v1/completions", content=body, timeout=30,
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 415 and r.json()["error"] == {
        "message": "Content-Encoding gzip is not supported; send the JSON body uncompressed",
        "type": "invalid_request_error", "param": None, "code": "unsupported_encoding"}, r.text


def test_a_temperature_below_1e_5_is_greedy(server: str) -> None:
    """1e-40 divided the logits into inf: a 500 ("probability tensor contains inf")."""
    texts = []
    for temperature in (0, 1e-40):
        r = httpx.post(f"{server}/v1/completions", json={"model": "gpt2", "prompt": "The", "max_tokens": 6,
                                                          "temperature": temperature, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1] and texts[0]


def test_health_is_503_while_loading() -> None:
    async def scenario() -> None:
        app = build_app(ServerState(ServerSettings()))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
            r = await client.post("/v1/completions", json={"model": "gpt2", "prompt": "x"})
            assert r.status_code == 503

    asyncio.run(scenario())


def test_serve_option_errors_are_one_line(capsys, tmp_path: Path) -> None:
    assert main(["serve", "--weights", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    (tmp_path / "key").write_text("")
    assert main(["serve", "--api-key-file", str(tmp_path / "key"), "--weights", str(tmp_path)]) == 2
    assert "the API key file is empty" in capsys.readouterr().err
    assert main(["serve", "--parallel", "0", "--weights", str(tmp_path)]) == 2
    assert "--parallel must be at least 1, got 0" in capsys.readouterr().err


def test_model_is_optional_and_the_icon_is_served(trained_model: GPT2) -> None:
    with live(trained_model, parallel=1, max_queue=2) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "The", "max_tokens": 3, "temperature": 0})  # as curl users send it
        assert r.status_code == 200 and r.json()["model"] == "gpt2"
        expected = trained_model.complete(["The"], max_new_tokens=3, temperature=0)[0].text
        assert r.json()["choices"][0]["text"] == expected
        icon = c.get("/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")


# --- faults: every client gets its answer or its error, and the engine goes on ----------------------------------


def fail_once(obj: object, name: str, error: BaseException) -> list[int]:
    """Make obj.name raise `error` on its next call only; returns a list that counts the calls."""
    original, calls = getattr(obj, name), []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return original(*args, **kwargs)

    setattr(obj, name, faulty)
    return calls


def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """The bodies posted at once, each answered within 60 s (a hang fails the test)."""
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(httpx.post, f"{url}/v1/completions", json=b, timeout=60) for b in bodies]
        return [f.result(timeout=90) for f in futures]


def streamed_events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("error", [RuntimeError("kernel exploded"), MemoryError("no room for the pass")])
def test_a_pass_that_raises_fails_its_requests_and_the_engine_goes_on(trained_model: GPT2, error) -> None:
    body = {"prompt": "The", "max_tokens": 5, "temperature": 0}
    with live(trained_model, parallel=4, max_queue=4) as (url, engine):
        calls = fail_once(engine.loop.runner, "open", error)
        [whole] = post_all(url, [body])
        assert calls  # the fault fired
        assert whole.status_code == 500
        err = whole.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        assert f"{type(error).__name__}: {error}" in err["message"]
        fail_once(engine.loop.runner, "open", error)
        [stream] = post_all(url, [{**body, "stream": True}])
        assert stream.status_code == 200 and "error" in streamed_events(stream)[-1]
        assert "data: [DONE]" not in stream.text  # a failed stream ends with its error chunk
        ok = httpx.post(f"{url}/v1/completions", json=body, timeout=60)  # the engine goes on
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["text"] == trained_model.complete(["The"], max_new_tokens=5, temperature=0)[0].text
        wait_for(lambda: engine.loop.scheduler.running == 0 and engine.held == 0, "every slot to be free")
        assert parse(httpx.get(f"{url}/metrics").text)['gpt2_requests_finished_total{reason="error"}'] >= 1


def test_a_failed_prefill_fails_only_its_request(trained_model: GPT2) -> None:
    with live(trained_model, parallel=2, max_queue=2) as (url, engine):
        fail_once(engine.loop.runner, "prefill", MemoryError())
        scored, other = post_all(url, [{"prompt": "The cat sat", "max_tokens": 0, "echo": True, "logprobs": 1},
                                       {"prompt": "Return the", "max_tokens": 8, "temperature": 0, "ignore_eos": True}])
        assert scored.status_code == 500 and "MemoryError" in scored.json()["error"]["message"]
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 8


def test_a_sampler_that_raises_fails_only_its_sequence(trained_model: GPT2, monkeypatch) -> None:
    from gpt2_engine.runtime import scheduler

    calls = fail_once(scheduler, "choose", ValueError("bad distribution"))
    monkeypatch.setattr(scheduler, "choose", scheduler.choose)  # undone after the test
    with live(trained_model, parallel=2, max_queue=2) as (url, engine):
        first = httpx.post(f"{url}/v1/completions", json={"prompt": "The", "max_tokens": 4}, timeout=60)
        assert first.status_code == 500 and "ValueError: bad distribution" in first.json()["error"]["message"]
        again = httpx.post(f"{url}/v1/completions", json={"prompt": "The", "max_tokens": 4}, timeout=60)
        assert again.status_code == 200 and len(calls) > 1


def test_a_fatal_failure_answers_everyone_and_health_turns_503(trained_model: GPT2) -> None:
    with live(trained_model, parallel=2, max_queue=2) as (url, engine):
        fail_once(engine.loop.scheduler, "schedule", RuntimeError("scheduler state is broken"))
        [r] = post_all(url, [{"prompt": "The", "max_tokens": 4}])
        assert r.status_code == 500 and "scheduler state is broken" in r.json()["error"]["message"]
        wait_for(lambda: not engine.thread.is_alive(), "the engine thread to stop")
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_failed"
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "The", "max_tokens": 4}, timeout=60)
        assert late.status_code == 503 and "scheduler state is broken" in late.json()["error"]["message"]


FATAL_SERVER = """
import sys
from gpt2_engine.cli import main
from gpt2_engine.runtime.scheduler import Scheduler

plain = Scheduler.schedule
def schedule(self):
    if any(s is not None and s.tokens for s in self.slots):  # once a sequence has its first token
        raise RuntimeError("injected fatal fault")
    return plain(self)
Scheduler.schedule = schedule
sys.exit(main(sys.argv[1:]))
"""


def test_gpt2_serve_exits_non_zero_after_a_fatal_failure(trained_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "fatal_server.py"
    script.write_text(FATAL_SERVER)
    proc = subprocess.Popen([sys.executable, str(script), "serve", "--weights", str(trained_dir), "--port", str(port),
                             "--threads", str(THREADS)], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: proc.poll() is not None or healthy(url), "the server to start", SERVER_START)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "The", "max_tokens": 8, "stream": True}, timeout=60)
        assert "injected fatal fault" in streamed_events(r)[-1]["error"]["message"]
        assert proc.wait(timeout=30) == 2
        assert proc.stderr.read().strip().splitlines()[-1] == (
            "gpt2 serve: error: the engine stopped: RuntimeError: injected fatal fault")
    finally:
        proc.kill()
        proc.wait()



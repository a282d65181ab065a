"""A soak of `gpt2 serve` (loopback, bounded in time and count): for about 30 s, twice as many clients as slots send
a mix of streaming and whole completions, cancel streams midway, send bad requests, long prompts and echo scoring.
Afterwards no slot is held, every response was well-formed, every greedy output equals its output alone, and the
server's memory grew by less than 5%. The figures go to .cache/artifacts/soak.json."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import ARTIFACTS
from conftest import SERVER_START, free_port, healthy, wait_for

from gpt2_engine import GPT2
from gpt2_engine.serve.metrics import parse

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-fast and make test leave it out

SECONDS = 30
SLOTS = 4
PROMPTS = ["The file", "Return the", "If the argument is", "This module provides", "Raises an"]
LONG_PROMPT = "Return a new list of the items in the order given. " * 30  # ~330 tokens: prefilled alone


def kinds(trained_model: GPT2) -> dict:
    """What each kind of request sends, and what its answer must be."""
    greedy = {p: trained_model.complete([p], max_new_tokens=12, temperature=0)[0].text for p in PROMPTS}
    long_text = trained_model.complete([LONG_PROMPT], max_new_tokens=6, temperature=0)[0].text
    return {"greedy": greedy, "long": long_text}


def one_request(url: str, client: httpx.Client, n: int, expected: dict) -> str:
    """Request number n of a client: its kind, checked. Raises AssertionError on a malformed answer."""
    kind = ["stream", "whole", "cancel", "bad", "long", "echo", "sampled"][n % 7]
    prompt = PROMPTS[n % len(PROMPTS)]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    if kind == "stream":
        r = client.post(f"{url}/v1/completions", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected["greedy"][prompt]
    elif kind == "whole":
        r = client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected["greedy"][prompt]
    elif kind == "cancel":
        with client.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 200, "ignore_eos": True,
                                                                   "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(2):
                assert next(line for line in lines if line.startswith("data: {"))
    elif kind == "bad":
        r = client.post(f"{url}/v1/completions", json={**body, "temperature": -1})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif kind == "long":
        r = client.post(f"{url}/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["long"]
    elif kind == "echo":
        r = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
        lp = r.json()["choices"][0]["logprobs"]
        assert r.status_code == 200 and lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) >= 2
    else:
        r = client.post(f"{url}/v1/completions", json={**body, "temperature": 0.9, "seed": n, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
    return kind


def soak_client(url: str, index: int, deadline: float, expected: dict) -> Counter:
    done: Counter = Counter()
    with httpx.Client(timeout=60) as client:
        for n in range(index, index + 10_000):  # bounded in count as well as in time
            if time.monotonic() > deadline:
                break
            done[one_request(url, client, n, expected)] += 1
    return done


def test_soak(trained_dir: Path, trained_model: GPT2) -> None:
    expected = kinds(trained_model)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpt2_engine", "serve", "--weights", str(trained_dir), "--port",
                             str(port), "--parallel", str(SLOTS), "--threads", "2"], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or healthy(url), "the server to start", SERVER_START)
        assert proc.poll() is None, proc.stderr.read()
        server = psutil.Process(proc.pid)
        with httpx.Client(timeout=60) as client:  # every kind once, so that the baseline holds what they allocate
            for n in range(7):
                one_request(url, client, n, expected)
        rss_before = server.memory_info().rss
        deadline = time.monotonic() + SECONDS
        with concurrent.futures.ThreadPoolExecutor(2 * SLOTS) as pool:
            futures = [pool.submit(soak_client, url, i, deadline, expected) for i in range(2 * SLOTS)]
            counts = sum((f.result(timeout=SECONDS + 120) for f in futures), Counter())
        wait_for(lambda: parse(httpx.get(f"{url}/metrics").text)["gpt2_requests_running"] == 0, "every slot free")
        m = parse(httpx.get(f"{url}/metrics").text)
        rss_after = server.memory_info().rss
        figures = {"seconds": SECONDS, "clients": 2 * SLOTS, "slots": SLOTS, "requests": dict(counts),
                   "rss_before_mib": rss_before / 2**20, "rss_after_mib": rss_after / 2**20,
                   "rss_growth": rss_after / rss_before - 1,
                   "finished": {k: v for k, v in m.items() if k.startswith("gpt2_requests_finished_total")}}
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "soak.json").write_text(json.dumps(figures, indent=2) + "\n")
        assert m["gpt2_requests_waiting"] == 0 and m["gpt2_slots_busy"] == 0
        assert m.get('gpt2_requests_finished_total{reason="error"}', 0) == 0
        assert m['gpt2_requests_finished_total{reason="cancelled"}'] >= counts["cancel"]
        assert min(counts[k] for k in ("stream", "whole", "cancel", "bad", "long", "echo", "sampled")) >= 1
        assert rss_after < 1.05 * rss_before, figures
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert "Traceback" not in proc.stderr.read()

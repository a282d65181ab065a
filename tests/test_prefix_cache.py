"""The prefix cache (runtime/prefix.py): hits, eviction under a bound, sharing across slots and concurrent requests,
echo scoring on a cached prefix, and results equal to those without the cache (1e-5 relative, greedy ids equal)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
import torch
from test_serve import live

from gpt2_engine import GPT2
from gpt2_engine.cli import main
from gpt2_engine.core.errors import GPT2EngineError
from gpt2_engine.core.model import KVCache
from gpt2_engine.runtime.loop import EngineLoop
from gpt2_engine.runtime.prefix import BLOCK_TOKENS, PrefixCache, prefill
from gpt2_engine.runtime.requests import Request
from gpt2_engine.runtime.runner import ModelRunner
from gpt2_engine.runtime.sampling import SamplingParams
from gpt2_engine.serve.metrics import parse

TOL = 1e-5
PREAMBLE = ("Return the number of items in a container. The argument may be a sequence (such as a string, bytes, "
            "tuple, list, or range) or a collection (such as a dictionary, set, or frozen set).")


def ids(model: GPT2, text: str) -> list[int]:
    return model.tokenizer.encode(text)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def block_mb(model: GPT2) -> float:
    c = model.config
    return 2 * c.n_layer * c.n_embd * BLOCK_TOKENS * 4 / 2**20


def test_a_cached_prefix_gives_the_uncached_results(trained_model: GPT2) -> None:
    w, cfg = trained_model.weights, trained_model.config
    cache, view = PrefixCache(cfg, 8), KVCache.allocate(cfg, 1, cfg.n_positions)
    base = ids(trained_model, PREAMBLE)
    c = len(base) // BLOCK_TOKENS * BLOCK_TOKENS  # whole blocks of the preamble
    first = prefill(w, cfg, view, base + ids(trained_model, " Raise an error."), scored=True, top=2, prefix=cache)
    assert first.cached == 0 and len(cache) == (len(base) + 4) // BLOCK_TOKENS
    for tail in (" Return a list.", " Raise a ValueError for a negative length."):
        prompt = base + ids(trained_model, tail)
        hit = prefill(w, cfg, view, prompt, scored=True, top=2, prefix=cache)
        alone = prefill(w, cfg, KVCache.allocate(cfg, 1, cfg.n_positions), prompt, scored=True, top=2)
        assert hit.cached == c - 1  # the last cached position runs again: its logits predict the first new token
        assert rel(hit.logits, alone.logits) < TOL
        assert hit.stats.logprob.shape == alone.stats.logprob.shape == (len(prompt) - 1,)
        assert float((hit.stats.logprob - alone.stats.logprob).abs().max()) < TOL * 10  # nats; |logprob| <= ~15
        assert torch.equal(hit.stats.top_ids, alone.stats.top_ids) and torch.equal(hit.stats.rank, alone.stats.rank)
    assert cache.counters.hit == 2 * (c - 1)


def test_a_wholly_cached_prompt_scores_from_the_memo(trained_model: GPT2) -> None:
    w, cfg = trained_model.weights, trained_model.config
    cache, view = PrefixCache(cfg, 8), KVCache.allocate(cfg, 1, cfg.n_positions)
    prompt = ids(trained_model, PREAMBLE)[: 2 * BLOCK_TOKENS]
    alone = prefill(w, cfg, view, prompt, scored=True, top=1, prefix=cache)
    again = prefill(w, cfg, view, prompt, scored=True, top=1, prefix=cache)
    assert again.cached == 2 * BLOCK_TOKENS - 1  # only the last position runs, for the next token's logits
    assert torch.equal(again.stats.logprob, alone.stats.logprob) and torch.equal(again.stats.rank, alone.stats.rank)
    assert rel(again.logits, alone.logits) < TOL


def test_the_memo_serves_fewer_alternatives_and_recomputes_for_more(trained_model: GPT2) -> None:
    w, cfg = trained_model.weights, trained_model.config
    cache, view = PrefixCache(cfg, 8), KVCache.allocate(cfg, 1, cfg.n_positions)
    prompt = ids(trained_model, PREAMBLE)
    prefill(w, cfg, view, prompt, scored=True, top=1, prefix=cache)
    wider = prefill(w, cfg, view, prompt, scored=True, top=3, prefix=cache)
    assert wider.cached == 0  # the memo holds one alternative: every position ran again
    alone = prefill(w, cfg, KVCache.allocate(cfg, 1, cfg.n_positions), prompt, scored=True, top=3)
    assert torch.equal(wider.stats.top_ids, alone.stats.top_ids)
    narrower = prefill(w, cfg, view, prompt, scored=True, top=2, prefix=cache)  # the memo now holds 3
    assert narrower.cached > 0 and torch.equal(narrower.stats.top_ids, alone.stats.top_ids[:, :2])


def test_eviction_keeps_the_bound_and_drops_leaves_first(trained_model: GPT2) -> None:
    w, cfg = trained_model.weights, trained_model.config
    cache, view = PrefixCache(cfg, 3 * block_mb(trained_model)), KVCache.allocate(cfg, 1, cfg.n_positions)
    assert cache.capacity == 3
    a = (ids(trained_model, PREAMBLE) * 2)[: 5 * BLOCK_TOKENS]
    assert len(a) == 5 * BLOCK_TOKENS
    prefill(w, cfg, view, a, prefix=cache)
    assert len(cache) == 3  # blocks 0-2; block 3 would need a row held by its own ancestors
    b = list(range(1000, 1000 + 2 * BLOCK_TOKENS))
    prefill(w, cfg, view, b, prefix=cache)
    assert len(cache) == 3 and len(cache.match(b, None)) == 2
    assert len(cache.match(a, None)) == 1  # a's two deepest blocks were evicted, its first survives


def test_adapters_do_not_share_blocks(trained_model: GPT2) -> None:
    cache = PrefixCache(trained_model.config, 8)
    view = KVCache.allocate(trained_model.config, 1, trained_model.config.n_positions)
    prompt = ids(trained_model, PREAMBLE)
    prefill(trained_model.weights, trained_model.config, view, prompt, prefix=cache)
    assert cache.match(prompt, None) and not cache.match(prompt, 1)


def run_loop(loop: EngineLoop, requests: list[Request], tag: str) -> dict:
    loop.submit(requests, tag)
    out: dict = {}
    for _ in range(1000):
        for step in loop.step():
            for seq, event in step:
                if seq.tag == tag:
                    out.setdefault(seq.index, []).append(event)
        if loop.scheduler.idle:
            return out
    raise AssertionError("the loop did not finish")


def test_a_prefix_is_shared_across_slots_with_greedy_ids_unchanged(trained_model: GPT2) -> None:
    from gpt2_engine.runtime.scheduler import Scheduler

    cfg = trained_model.config
    prompt = ids(trained_model, PREAMBLE)
    greedy = SamplingParams(temperature=0)
    loop = EngineLoop(Scheduler(cfg, trained_model.tokenizer, slots=2),
                      ModelRunner(trained_model.weights, cfg, slots=2, prefix=PrefixCache(cfg, 8)))
    first = Request(prompt + ids(trained_model, " It"), 30, greedy, ignore_eos=True)
    loop.submit([first], "a")
    next(loop.step())  # a is prefilled into slot 0 and keeps running there
    assert loop.scheduler.slots[0] is not None
    second = Request(prompt + ids(trained_model, " The"), 20, greedy, ignore_eos=True)
    events = run_loop(loop, [second], "b")[0]
    assert events[0].cached_tokens == len(prompt) // BLOCK_TOKENS * BLOCK_TOKENS - 1
    expected = trained_model.generate_ids(second.prompt, max_new_tokens=20, temperature=0, ignore_eos=True)
    assert [e.token for e in events if e.token is not None] == expected


def test_concurrent_requests_with_one_prefix_hit_the_first_ones_blocks(trained_model: GPT2) -> None:
    prompt = PREAMBLE + " Return"
    n = len(ids(trained_model, prompt))
    with live(trained_model, parallel=4, max_queue=4, prefix_cache_mb=8) as (url, engine):
        bodies = [{"prompt": prompt + tail, "max_tokens": 4, "temperature": 0} for tail in (" a", " the", " an")]
        responses = [None] * 3

        def post(i: int) -> None:
            responses[i] = httpx.post(f"{url}/v1/completions", json=bodies[i], timeout=60)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        cached = sorted(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses)
        assert cached == [0, n // BLOCK_TOKENS * BLOCK_TOKENS - 1, n // BLOCK_TOKENS * BLOCK_TOKENS - 1]
        for body, r in zip(bodies, responses):
            assert r.json()["choices"][0]["text"] == trained_model.generate(body["prompt"], max_new_tokens=4,
                                                                            temperature=0)
        m = parse(httpx.get(f"{url}/metrics").text)
        assert m["gpt2_prefix_cache_hits_total"] == sum(cached)
        assert m["gpt2_prefix_cache_queries_total"] == sum(len(ids(trained_model, b["prompt"])) for b in bodies)


def echo(url: str, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_scoring_on_a_cached_prefix_equals_a_server_without_the_cache(trained_model: GPT2) -> None:
    prompts = [PREAMBLE + " It returns", PREAMBLE + " It raises"]
    with live(trained_model, parallel=2, max_queue=2, prefix_cache_mb=None) as (url, _):
        plain = [echo(url, p) for p in prompts]
    with live(trained_model, parallel=2, max_queue=2, prefix_cache_mb=8) as (url, _):
        cached = [echo(url, p) for p in prompts]
    assert plain[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for a, b in zip(cached, plain):
        la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
        assert la["tokens"] == lb["tokens"] and la["token_logprobs"][0] is None
        assert max(abs(x - y) for x, y in zip(la["token_logprobs"][1:], lb["token_logprobs"][1:])) < 10 * TOL
        assert [list(t) for t in la["top_logprobs"][1:]] == [list(t) for t in lb["top_logprobs"][1:]]


def test_score_reuses_a_shared_preamble_with_the_same_results(trained_model: GPT2) -> None:
    texts = [PREAMBLE + " It returns the length.", PREAMBLE + " It raises a TypeError."]
    plain = trained_model.score(texts, context=64, stride=32)
    cached = trained_model.score(texts, context=64, stride=32, prefix_cache_mb=8)
    for a, b in zip(cached, plain):
        assert a.tokens == b.tokens and abs(a.nll - b.nll) / b.nll < TOL


@pytest.mark.parametrize("args, fragment", [
    (["--prefix-cache-mb", "0"], "--prefix-cache-mb must be a positive, finite number of MB, got 0.0"),
    (["--prefix-cache-mb", "64", "--no-prefix-cache"], "--prefix-cache-mb and --no-prefix-cache contradict"),
    (["--prefix-cache-mb", "0.05"], "--prefix-cache-mb 0.05 holds no block: a block of 16 tokens of this model takes "
                                    "0.12 MB"),
])
def test_prefix_cache_option_errors(capsys, trained_dir: Path, args: list[str], fragment: str) -> None:
    assert main(["serve", "--weights", str(trained_dir), *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_score_refuses_a_cache_of_no_size(capsys, trained_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text(PREAMBLE)
    assert main(["score", str(tmp_path / "doc.txt"), "--weights", str(trained_dir), "--prefix-cache-mb", "-1"]) == 2
    err = capsys.readouterr().err
    assert "prefix cache size must be a positive number of MB, got -1.0" in err and err.count("\n") == 1


def test_a_model_that_fails_to_load_ends_gpt2_serve_with_its_error(capsys, trained_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((trained_dir / "config.json").read_text())  # and no weights file
    assert main(["serve", "--weights", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "gpt2 serve: error: the model failed to load:" in err and "Traceback" not in err


def test_a_cache_too_small_for_one_block_is_refused(trained_model: GPT2) -> None:
    with pytest.raises(GPT2EngineError, match="holds no block: a block of 16 tokens takes 0.12 MB"):
        PrefixCache(trained_model.config, 0.01)

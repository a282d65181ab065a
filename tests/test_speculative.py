"""Speculative decoding (runtime/speculation.py): greedy ids identical to plain decoding for every drafter and K, drafts
that fail at chosen positions, the KV cache after rejections, batches, the server, errors, and speculative sampling's
output distribution against the exact one (a chi-square test at a stated level)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import run_pass

from gpt2_engine import GPT2
from gpt2_engine.core.config import GPT2Config
from gpt2_engine.core.errors import GenerationError, WeightsError
from gpt2_engine.core.model import KVCache
from gpt2_engine.core.tokenizer import load_tokenizer
from gpt2_engine.core.weights import GPT2Weights, assemble, named_tensors
from gpt2_engine.runtime.drafters import Speculation, lookup
from gpt2_engine.runtime.generate import Generation
from gpt2_engine.runtime.loop import EngineLoop
from gpt2_engine.runtime.plan import Draft, DraftAsk, Segment
from gpt2_engine.runtime.requests import GenerationSettings, Request
from gpt2_engine.runtime.runner import ModelRunner
from gpt2_engine.runtime.sampling import SamplingParams, apply_penalties, probabilities
from gpt2_engine.runtime.scheduler import Scheduler
from gpt2_engine.runtime.speculation import SpeculationPolicy, next_k
from gpt2_engine.train.step import initial_weights

PROMPTS = ["Return the number of", "import os\n", "The default value of the"]


def greedy(model: GPT2, ids: list[int], n: int, **speculation) -> tuple[list[int], object]:
    run = model.generation([ids], max_new_tokens=n, temperature=0, ignore_eos=True, **speculation)
    return run.run()[0].token_ids, run.stats


@pytest.mark.parametrize("drafter", ["ngram", "int4", "int8", "self"])
def test_greedy_ids_equal_plain_decoding_for_every_drafter_and_k(trained_model: GPT2, trained_dir: Path,
                                                                   drafter: str) -> None:
    source = str(trained_dir) if drafter == "self" else drafter
    for prompt in PROMPTS:
        ids = trained_model.tokenizer.encode(prompt)
        plain, _ = greedy(trained_model, ids, 40)
        for k in [None, 1, 2, 3, 4, 5, 6, 7, 8]:
            out, stats = greedy(trained_model, ids, 40, speculate=source, draft_tokens=k)
            assert out == plain, (prompt, k)
            assert stats.verify_passes > 0 and stats.new_tokens == 40
            if drafter == "self":  # the target drafting for itself: every draft is accepted
                assert stats.accepted == stats.drafted > 0


@pytest.mark.parametrize("drafter", ["ngram", "int4"])
def test_greedy_ids_equal_plain_decoding_on_the_full_size_fixture(model: GPT2, drafter: str) -> None:
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown")
    plain, _ = greedy(model, ids, 12)
    for k in [None, 1, 4, 8]:
        out, stats = greedy(model, ids, 12, speculate=drafter, draft_tokens=k)
        assert out == plain, k


@dataclass(frozen=True)
class Oracle(Speculation):
    """Drafts the known greedy continuation with a wrong token at index `wrong` of each draft (None: all right)."""

    truth: tuple[int, ...] = ()
    wrong: int | None = None

    def drafter(self, slots: int, max_len: int):
        outer = self

        class Drafter:
            def propose(self, asks: list[DraftAsk]) -> list[Draft]:
                drafts = []
                for ask in asks:
                    tokens = list(outer.truth[len(ask.context) : len(ask.context) + ask.k])
                    if outer.wrong is not None and outer.wrong < len(tokens):
                        tokens[outer.wrong] = (tokens[outer.wrong] + 1) % 50257
                    drafts.append(Draft(tokens))
                return drafts

        return Drafter()


def run_loop(model: GPT2, prompt: list[int], n: int, spec: Speculation | None) -> tuple[list[int], ModelRunner, object]:
    """One greedy sequence through an EngineLoop of its own: (its tokens, the runner, the sequence)."""
    config, max_len = model.config, len(prompt) + n
    runner = ModelRunner(model.weights, config, slots=2, max_len=max_len)
    loop = EngineLoop(Scheduler(config, model.tokenizer, slots=2, max_len=max_len, speculation=None if spec is None else spec.policy), runner,
                      None if spec is None else spec.drafter(2, max_len))
    request = Request(prompt, n, SamplingParams(temperature=0), ignore_eos=True)
    loop.submit([request], tag="t")
    loop.intake()
    seq = loop.scheduler.waiting[0]
    while not loop.scheduler.idle:
        for _ in loop.step():
            pass
    return seq.tokens, runner, seq


@pytest.mark.parametrize("wrong", [0, 2, 4, None])  # the first, a middle and the last of K = 5 drafts; none
def test_rejected_drafts_leave_the_cache_as_plain_decoding_writes_it(trained_model: GPT2, wrong: int | None) -> None:
    prompt = trained_model.tokenizer.encode("Return the number of items in the")
    n = 30
    plain, plain_runner, plain_seq = run_loop(trained_model, prompt, n, None)
    truth = tuple(prompt + plain)
    spec = Oracle("oracle", None, None, SpeculationPolicy(draft_tokens=5), truth=truth, wrong=wrong)
    out, runner, seq = run_loop(trained_model, prompt, n, spec)
    assert out == plain
    assert seq.verified > 0
    if wrong is None:
        assert seq.accepted == seq.drafted
    else:
        # every pass accepts exactly the drafts before the wrong one (the last pass may draft fewer than that)
        assert wrong * (seq.verified - 1) <= seq.accepted <= wrong * seq.verified
    end = seq.position  # positions the sequence has fed: both runs wrote these, and only these are ever read
    assert end == plain_seq.position == len(prompt) + n - 1
    assert torch.equal(runner.cache.k[:, 0, :, :end], plain_runner.cache.k[:, 0, :, :end])
    assert torch.equal(runner.cache.v[:, 0, :, :end], plain_runner.cache.v[:, 0, :, :end])


def test_batches_with_speculation_equal_plain_decoding(trained_model: GPT2) -> None:
    ids = [trained_model.tokenizer.encode(p) for p in PROMPTS]
    plain = trained_model.generation(ids, max_new_tokens=24, temperature=0).run()
    for source in ["ngram", "int4"]:
        run = trained_model.generation(ids, max_new_tokens=24, temperature=0, speculate=source)
        assert [c.token_ids for c in run.run()] == [c.token_ids for c in plain]
        assert [c.finish_reason for c in run.completions] == [c.finish_reason for c in plain]
        assert [c.logprobs for c in run.completions] == [c.logprobs for c in plain]  # the same rows' bits


def test_sampling_with_a_seed_is_reproducible(trained_model: GPT2) -> None:
    kwargs = dict(max_new_tokens=30, temperature=0.9, top_k=20, seed=7, speculate="int4", draft_tokens=3,
                  ignore_eos=True)  # the trained fixture (made on the machine) may end a sample early
    first = trained_model.generate_ids([464, 2163], **kwargs)
    assert first == trained_model.generate_ids([464, 2163], **kwargs)
    assert len(first) == 30


def test_prompt_lookup() -> None:
    assert lookup([5, 6, 7, 8, 9, 5, 6], 3) == [7, 8, 9]  # after the last "5 6"
    assert lookup([1, 2, 3, 1, 2, 4, 1, 2], 2) == [4, 1]  # the latest occurrence wins
    assert lookup([7, 7, 7], 5) == [7, 7, 7, 7, 7]  # a repeating stretch goes on past the context's end
    assert lookup([1, 2, 3], 4) == []  # nothing earlier matches
    assert lookup([3], 4) == []


def test_adaptive_k_grows_shrinks_and_pauses() -> None:
    assert next_k(4, 4, 4, 8) == 5 and next_k(8, 8, 8, 8) == 8
    assert next_k(6, 6, 2, 8) == 2 and next_k(6, 6, 5, 8) == 3
    assert next_k(1, 1, 0, 8) == 0


def test_errors(trained_model: GPT2, trained_dir: Path, tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(GenerationError, match=r"draft_tokens must be an integer in \[1, 16\]"):
        trained_model.generation("x", speculate="ngram", draft_tokens=0)
    with pytest.raises(GenerationError, match="give speculate= too"):
        trained_model.generation("x", draft_tokens=3)
    with pytest.raises(GenerationError, match="expected 'int4', 'int8', 'ngram' or a GPT-2 checkpoint directory"):
        trained_model.generation("x", speculate="int5")
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "vocab.json", "merges.txt"):
        (other / name).write_bytes((trained_dir / name).read_bytes())
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 50000}))
    with pytest.raises(WeightsError, match="vocabulary has 50000 tokens, the target's 50257"):
        trained_model.generation("x", speculate=str(other))
    (other / "config.json").write_text(json.dumps(config))
    # a valid BPE of its own: the last two merges in the other order (so tokens 50254 and 50255 trade places)
    lines = (trained_dir / "merges.txt").read_text(encoding="utf-8").rstrip("\n").split("\n")
    lines[-2], lines[-1] = lines[-1], lines[-2]
    (other / "merges.txt").write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # not the official size either
    vocab = json.loads((trained_dir / "vocab.json").read_text(encoding="utf-8"))
    a, b = ("".join(line.split()) for line in lines[-2:])
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "vocab.json").write_text(json.dumps(vocab, indent=0), encoding="utf-8")
    with pytest.raises(WeightsError, match="tokenizer .* differs from the target's"):
        trained_model.generation("x", speculate=str(other))
    quantized = GPT2.from_pretrained(tiny_dir, quantize="int8")
    with pytest.raises(GenerationError, match="already quantized or bfloat16"):
        quantized.generation("x", speculate="int4")


def gpt2(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpt2_engine", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_generate_speculate(trained_dir: Path, trained_model: GPT2) -> None:
    r = gpt2("generate", "Return the number of", "--weights", str(trained_dir), "--temperature", "0", "-n", "24",
             "--speculate", "ngram", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["token_ids"] == trained_model.complete(["Return the number of"], max_new_tokens=24, temperature=0)[0].token_ids
    spec = doc["speculation"]
    assert spec["drafter"] == "ngram" and spec["verify_passes"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    assert "drafted" in r.stderr and "tokens per verify pass" in r.stderr
    for args, message in [(["--speculate", "ngram", "--draft-tokens", "17"],
                           "--draft-tokens must be an integer in [1, 16] (or none: adaptive), got 17"),
                          (["--draft-tokens", "2"], "--draft-tokens applies to speculative decoding"),
                          (["--speculate", "nope"], "expected 'int4', 'int8', 'ngram' or a GPT-2 checkpoint")]:
        r = gpt2("generate", "x", "--weights", str(trained_dir), *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


# --- speculative sampling's distribution -----------------------------------------------------------------------------

TINY = GPT2Config(vocab_size=8, n_positions=16, n_embd=32, n_layer=1, n_head=2)
SAMPLES = 4000
LEVEL = 1e-3  # the chi-square test's significance level: a correct implementation fails it once in a thousand seeds


def tiny(seed: int) -> GPT2Weights:
    """Random weights with logits of order 1, so that the distributions are far from uniform and far from peaked."""
    w = initial_weights(TINY, torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    return assemble({k: t + 0.12 * torch.randn(t.shape, generator=g) for k, t in named_tensors(w).items()}, TINY)


def exact_pairs(w: GPT2Weights, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """[V, V]: the exact probability of (token 2, token 3) of a 3-token sample, token 1 summed out, under `sampling`
    (the repetition penalty counts the prompt and the tokens before)."""
    V = TINY.vocab_size

    def dist(ids: list[int]) -> torch.Tensor:
        seen = torch.zeros(V, dtype=torch.bool)
        seen[ids] = True
        # the context as rows of one pass: the bits generation's rows get (row-invariant kernels), so that no token
        # sits on the other side of the top-p boundary by a rounding difference
        cache = KVCache.allocate(TINY, 1, len(ids))
        logits = run_pass(w, TINY, [Segment(0, 0, ids)], cache)[0]
        return probabilities(apply_penalties(logits, sampling, seen, None), sampling).double()

    out = torch.zeros(V, V, dtype=torch.float64)
    p1 = dist(prompt)
    for a in range(V):
        p2 = dist(prompt + [a])
        for b in range(V):
            if p1[a] * p2[b] > 0:
                out[b] += p1[a] * p2[b] * dist(prompt + [a, b])
    return out


def chi_square_p(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square test of counts against probabilities, cells expected below 5 pooled."""
    n = counts.sum()
    expected = (expected_p * n).flatten()
    counts = counts.flatten().double()
    if counts[expected == 0].sum() > 0:  # a sample the distribution gives no mass: impossible under it
        return 0.0
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts[~small]
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected[~small]
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_speculative_sampling_has_the_targets_distribution(drafter: str) -> None:
    target, draft = tiny(1), tiny(2)
    tokenizer = load_tokenizer()
    prompt = [0, 1, 2, 3, 4, 5, 6, 7]  # every token once: prompt lookup always finds a draft
    sampling = SamplingParams(temperature=1.0, top_k=6, top_p=0.9, repetition_penalty=1.3)
    spec = Speculation(drafter, draft if drafter == "model" else None, TINY if drafter == "model" else None,
                       SpeculationPolicy(draft_tokens=1))
    settings = GenerationSettings(max_new_tokens=3, sampling=sampling, seed=0, num_samples=SAMPLES)
    run = Generation(target, TINY, tokenizer, [prompt], settings, spec)
    samples = [c.token_ids for c in run.run()]
    assert all(len(s) == 3 for s in samples)
    assert run.stats.verify_passes == SAMPLES  # token 1 from the prompt's pass, tokens 2 and 3 from one verify pass
    assert 0 < run.stats.accepted < run.stats.drafted  # both paths ran: acceptance and the residual draw
    counts = torch.zeros(TINY.vocab_size, TINY.vocab_size, dtype=torch.float64)
    for s in samples:
        counts[s[1], s[2]] += 1
    assert chi_square_p(counts, exact_pairs(target, prompt, sampling)) > LEVEL
    # the test has power: the same samples are far from what the draft model alone would give
    assert chi_square_p(counts, exact_pairs(draft, prompt, sampling)) < 1e-6


# --- gpt2 serve --speculate --------------------------------------------------------------------------------------------

def test_server_speculates_alone_and_batches_under_load(trained_model: GPT2) -> None:
    """One client at a time is served by verify passes, six at once by plain batched passes (more than
    SERVE_MAX_RUNNING run), and in between both; every output equals plain greedy decoding, token for token."""
    import concurrent.futures

    import httpx
    from test_serve import live

    from gpt2_engine.serve.metrics import parse

    prompts = PROMPTS + ["Raise an error if", "If the list is empty", "Return a new"]
    expected = {p: trained_model.complete([p], max_new_tokens=20, temperature=0)[0] for p in prompts}

    def ask(url: str, prompt: str) -> tuple[str, list[float]]:
        r = httpx.post(f"{url}/v1/completions", json={"model": "gpt2", "prompt": prompt, "max_tokens": 20,
                                                      "temperature": 0, "logprobs": 0}, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        if lp["tokens"] and lp["tokens"][-1] == "<|endoftext|>":  # listed, as OpenAI does; not in Completion.logprobs
            return choice["text"], lp["token_logprobs"][:-1]
        return choice["text"], lp["token_logprobs"]

    with live(trained_model, parallel=6, max_queue=8, speculate="int4") as (url, _):
        alone = ask(url, prompts[0])
        verified = parse(httpx.get(f"{url}/metrics").text)["gpt2_speculative_verify_passes_total"]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            together = list(pool.map(lambda p: ask(url, p), prompts))
        metrics = parse(httpx.get(f"{url}/metrics").text)
    want = [(expected[p].text, expected[p].logprobs) for p in prompts]
    assert alone == want[0]
    assert together == want  # the same text, and the same logprob bits: the rows are plain decoding's
    assert verified > 0
    assert 0 < metrics["gpt2_speculative_accepted_tokens_total"] <= metrics["gpt2_speculative_draft_tokens_total"]


def test_serve_speculation_flags_are_checked(trained_dir: Path, tmp_path: Path) -> None:
    from conftest import cli

    def serve(*args: str) -> tuple[int, str]:
        return cli("serve", "--weights", str(trained_dir), "--port", "0", *args)

    assert serve("--draft-tokens", "3") == (2, "gpt2 serve: error: --draft-tokens applies to speculative decoding: "
                                               "give --speculate too\n")
    assert serve("--speculate", "ngram", "--draft-tokens", "0") == (
        2, "gpt2 serve: error: --draft-tokens must be an integer in [1, 16] (or none: adaptive), got 0\n")
    assert serve("--speculate", "int4", "--quantize", "int8") == (
        2, "gpt2 serve: error: --speculate int4 drafts with the float32 model quantized; this server runs int8 (use "
           "ngram or a draft checkpoint)\n")
    code, err = serve("--speculate", str(tmp_path))
    assert code == 2 and err.startswith(f"gpt2 serve: error: --speculate {tmp_path}: speculate: expected 'int4', "
                                        "'int8', 'ngram' or a GPT-2 checkpoint directory")


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_one_function_speculative_greedy_gives_the_engines_ids(trained_model: GPT2, k: int) -> None:
    """runtime/speculative.py (gpt-fast's draft-and-verify in one function, int4 drafting for float32) gives the ids the
    engine's speculative loop gives, which are plain greedy decoding's."""
    from gpt2_engine.core.quantize import quantize_weights
    from gpt2_engine.runtime.speculative import speculative_greedy

    cfg, accepted = trained_model.config, 0
    for prompt in PROMPTS:
        ids = trained_model.tokenizer.encode(prompt)
        n = 40
        target = ModelRunner(trained_model.weights, cfg, slots=1, max_len=len(ids) + n - 1)
        draft = ModelRunner(quantize_weights(trained_model.weights, "int4"), cfg, slots=1, max_len=len(ids) + n - 1)
        out = speculative_greedy(target, draft, ids, n, k, eot=trained_model.tokenizer.eot_id)
        run = trained_model.generation([ids], max_new_tokens=n, temperature=0, speculate="int4", draft_tokens=k)
        engine = run.run()[0].token_ids
        plain = trained_model.generation([ids], max_new_tokens=n, temperature=0).run()[0].token_ids
        assert out == engine == plain, (prompt, k)
        accepted += run.stats.accepted
    assert accepted > 0  # the drafts were used (a prompt whose text ends at once drafts nothing)

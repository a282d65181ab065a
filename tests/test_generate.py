"""Generation: the KV cache, samplers against transformers' processors, batching, stop conditions, streaming."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from conftest import edited_copy, run_pass
from reference_sampling import process_logits, top_k_filter, top_p_filter

from gpt2_engine import GPT2, GenerationError
from gpt2_engine.core.model import KVCache, forward
from gpt2_engine.core.tokenizer import Detokenizer, incomplete_utf8_tail
from gpt2_engine.runtime.greedy import decode_one_token, greedy, prefill
from gpt2_engine.runtime.loop import EngineLoop
from gpt2_engine.runtime.plan import Segment
from gpt2_engine.runtime.requests import Request
from gpt2_engine.runtime.runner import ModelRunner, Pass
from gpt2_engine.runtime.sampling import SamplingParams, apply_penalties, apply_repetition_penalty, choose
from gpt2_engine.runtime.scheduler import Scheduler

PROMPTS = ["Hello, my dog is", "def main():\n    print(", "Zoë's café — 東京 🤖"]


# --- KV cache ---------------------------------------------------------------------------------------------------


def test_cached_decoding_equals_full_recompute(model: GPT2) -> None:
    """runtime/greedy.py's prefill and decode_one_token (the reading path's KV-cache loop): 200 steps of cached
    decoding give the logits of recomputing the whole sequence each time."""
    steps, prompt_len = 200, 12
    seq = torch.randint(0, 50257, (prompt_len + steps,), generator=torch.Generator().manual_seed(1)).tolist()
    w, cfg = model.weights, model.config
    cache = KVCache.allocate(cfg, 1, prompt_len + steps)
    with torch.inference_mode():
        step_logits = [prefill(w, cfg, cache, seq[:prompt_len])]
        for t in range(prompt_len, prompt_len + steps):  # 200 decode steps
            step_logits.append(decode_one_token(w, cfg, cache, seq[t], t))
        full = forward(w, cfg, torch.tensor([seq]))[0, prompt_len - 1 :]  # [steps + 1, V]
    cached = torch.stack(step_logits)
    worst = (cached - full).abs().max().item()
    assert worst <= 1e-4 * full.abs().max().item(), f"max |diff| {worst:.3g}"
    assert torch.equal(cached.argmax(-1), full.argmax(-1))


@pytest.mark.trained
def test_one_and_two_threads_give_the_same_logits_and_ids(trained_model: GPT2) -> None:
    """The engine's sums do not depend on the thread count (decode.cpp's fixed pieces, the head's per-row chains):
    the whole model's logits and a batch's greedy ids are the same bits at 1 and 2 threads. The suite's servers run
    the worker's count, as the models in its processes do, so this is its end-to-end check across counts (conftest's
    torch_threads_restored puts the worker's count back)."""
    ids, out = trained_model.tokenizer.encode(PROMPTS[0]), {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            logits = trained_model.forward(torch.tensor([ids]))
        texts = trained_model.complete(PROMPTS, max_new_tokens=16, temperature=0, ignore_eos=True)
        out[threads] = logits, [c.token_ids for c in texts]
    assert torch.equal(out[1][0], out[2][0])
    assert out[1][1] == out[2][1] and all(len(t) == 16 for t in out[1][1])


@pytest.mark.slow
def test_cached_batch_decoding_equals_full_recompute(model: GPT2) -> None:
    """The same for a batch of 3 sequences sharing the cache's batch dimension."""
    batch, steps, prompt_len = 3, 50, 12
    seq = torch.randint(0, 50257, (batch, prompt_len + steps), generator=torch.Generator().manual_seed(3))
    w, cfg = model.weights, model.config
    cache = KVCache.allocate(cfg, batch, prompt_len + steps)
    with torch.inference_mode():
        step_logits = [forward(w, cfg, seq[:, :prompt_len], cache=cache, start=0)[:, -1]]
        for t in range(prompt_len, prompt_len + steps):
            step_logits.append(forward(w, cfg, seq[:, t : t + 1], cache=cache, start=t)[:, -1])
        full = forward(w, cfg, seq)[:, prompt_len - 1 :]  # [B, steps + 1, V]
    cached = torch.stack(step_logits, dim=1)
    assert (cached - full).abs().max().item() <= 1e-4 * full.abs().max().item()
    assert torch.equal(cached.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("which", [pytest.param("model", marks=pytest.mark.slow), pytest.param("trained_model", marks=pytest.mark.trained)])
def test_the_reading_paths_greedy_equals_the_engine(which: str, request: pytest.FixtureRequest) -> None:
    """runtime/greedy.py's 40-line loop gives the token ids of GPT2.generate at temperature 0, <|endoftext|> included."""
    m = request.getfixturevalue(which)
    for prompt in PROMPTS:
        ids = m.tokenizer.encode(prompt)
        mine = greedy(m.weights, m.config, ids, 40, eot=m.tokenizer.eot_id)
        assert mine == m.generate_ids(ids, max_new_tokens=40, temperature=0), prompt
    assert greedy(m.weights, m.config, ids, 0) == []
    n = m.config.n_positions
    with pytest.raises(ValueError, match=f"- 1 <= {n} positions, got 3 tokens and max_new_tokens {n - 1}"):
        greedy(m.weights, m.config, [1, 2, 3], n - 1)


def test_cache_is_preallocated_and_bounded(model: GPT2) -> None:
    cache = KVCache.allocate(model.config, 2, 50)
    assert cache.k.shape == (12, 2, 12, 50, 64) and cache.v.shape == cache.k.shape
    with pytest.raises(ValueError, match="KV cache length must be in 1..1024"):
        KVCache.allocate(model.config, 1, 1025)


# --- parity of greedy decoding with transformers ------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_generate(model: GPT2, hf_model) -> None:
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        [mine] = model.complete([prompt], max_new_tokens=100, temperature=0, ignore_eos=True)
        with torch.no_grad():
            # min_new_tokens bans <|endoftext|> exactly as ignore_eos does
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=100, min_new_tokens=100, do_sample=False,
                                    pad_token_id=50256)[0, len(ids):].tolist()
        assert mine.token_ids == ref, prompt
        assert mine.text == model.tokenizer.decode(ref)


def test_batched_prompts_of_different_lengths_equal_generating_alone(model: GPT2) -> None:
    kwargs = dict(max_new_tokens=30, temperature=0, ignore_eos=True)
    alone = [model.generate(p, **kwargs) for p in PROMPTS]
    assert model.generate(PROMPTS, **kwargs) == alone
    assert len({len(model.tokenizer.encode(p)) for p in PROMPTS}) == 3  # really different lengths: padding is used


def test_batched_sampling_with_repetition_penalty_matches_alone_per_row(model: GPT2) -> None:
    kwargs = dict(max_new_tokens=20, temperature=0, repetition_penalty=1.3)
    assert model.generate(PROMPTS[:2], **kwargs) == [model.generate(p, **kwargs) for p in PROMPTS[:2]]


# --- samplers vs transformers' logits processors ------------------------------------------------------------------


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 50257, generator=g) * torch.tensor([[1.0], [3.0], [6.0], [0.5]])


@pytest.mark.parametrize("k", [1, 5, 40, 50257, 100000])
def test_top_k_keeps_the_same_tokens_as_transformers(logits: torch.Tensor, k: int) -> None:
    from transformers.generation.logits_process import TopKLogitsWarper

    ref = TopKLogitsWarper(top_k=min(k, 50257))(None, logits.clone())
    assert torch.equal(torch.isfinite(top_k_filter(logits, k)), torch.isfinite(ref))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.95, 0.999])
def test_top_p_keeps_the_same_tokens_as_transformers(logits: torch.Tensor, p: float) -> None:
    from transformers.generation.logits_process import TopPLogitsWarper

    ref = TopPLogitsWarper(top_p=p)(None, logits.clone())
    kept = torch.isfinite(top_p_filter(logits, p))
    assert torch.equal(kept, torch.isfinite(ref))
    assert kept.sum(-1).min() >= 1


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(logits: torch.Tensor, penalty: float) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    previous = torch.randint(0, 50257, (4, 30), generator=torch.Generator().manual_seed(1))
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, previous, True)
    ref = RepetitionPenaltyLogitsProcessor(penalty=penalty)(previous, logits.clone())
    assert torch.allclose(apply_repetition_penalty(logits, seen, penalty), ref, rtol=0, atol=0)


@pytest.mark.parametrize("k,p", [(40, 0.95), (0, 0.9), (5, 1.0), (1, 0.5), (200, 0.3)])
def test_choose_draws_only_what_the_reference_filters_keep(logits: torch.Tensor, k: int, p: float) -> None:
    """The engine's per-step sampler sorts only the top-k survivors; it must keep exactly the reference's set."""
    params = SamplingParams(temperature=0.9, top_k=k, top_p=p)
    kept = torch.isfinite(process_logits(logits, params))  # [4, V]
    g = torch.Generator().manual_seed(0)
    for row in range(4):
        draws = {choose(logits[row], params, g) for _ in range(300)}
        assert all(bool(kept[row, t]) for t in draws)
        if int(kept[row].sum()) == 1:
            assert draws == {int(logits[row].argmax())}
    assert choose(logits[2], SamplingParams(temperature=0), g) == int(logits[2].argmax())


def test_presence_frequency_penalties_and_logit_bias() -> None:
    logits = torch.zeros(10)
    counts = torch.tensor([0, 1, 3, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float32)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((7, 2.0), (1, -1.0)))
    out = apply_penalties(logits, params, None, counts)
    assert out.tolist() == [0, -1.75, -1.25, 0, 0, 0, 0, 2.0, 0, 0]  # bias, then -0.5 once and -0.25 per occurrence
    with pytest.raises(GenerationError, match=r"presence_penalty must be a number in \[-2, 2\]"):
        SamplingParams(presence_penalty=3)


# --- seeds, samples and settings ----------------------------------------------------------------------------------


def test_same_seed_same_text_different_seed_different_text(model: GPT2) -> None:
    a = model.generate("Once upon a time", max_new_tokens=25, seed=7, temperature=1.0, top_k=0, top_p=1.0)
    b = model.generate("Once upon a time", max_new_tokens=25, seed=7, temperature=1.0, top_k=0, top_p=1.0)
    c = model.generate("Once upon a time", max_new_tokens=25, seed=8, temperature=1.0, top_k=0, top_p=1.0)
    assert a == b and a != c


def test_several_samples_per_prompt(model: GPT2) -> None:
    texts = model.generate("The", max_new_tokens=10, seed=0, temperature=1.5, num_samples=3)
    assert isinstance(texts, list) and len(texts) == 3 and len(set(texts)) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be in [0, 2]"),
        (dict(temperature=math.nan), "temperature must be in [0, 2]"),
        (dict(temperature=math.inf), "temperature must be in [0, 2]"),
        (dict(temperature=2.5), "temperature must be in [0, 2]"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be in [0.01, 100] (1 disables it)"),
        (dict(max_new_tokens=1025), "asking for 1025 new tokens exceeds the context of 1024 tokens (at most 1024)"),
        (dict(max_new_tokens=1025, truncate="left"), "asking for 1025 new tokens exceeds the context of 1024 tokens"),
        (dict(stop=[""]), "stop strings must be non-empty strings"),
        (dict(top_kk=3), "unknown generation option(s): top_kk"),
        (dict(num_samples=10_001), "num_samples must be an integer in [1, 10000], got 10001"),  # the CLI's limit too
        (dict(top_logprobs=21), "top_logprobs must be an integer in [0, 20], got 21"),  # the server's
        (dict(temperature=True), "temperature must be in [0, 2] (0 is greedy), got bool True"),  # ran at 1.0
    ],
)
def test_invalid_settings_are_refused(model: GPT2, kwargs: dict, message: str) -> None:
    with pytest.raises(GenerationError) as e:
        model.generate("Hi", **kwargs)
    assert message in str(e.value)


def test_numpy_and_torch_numbers_are_numbers_and_other_types_are_named(model: GPT2) -> None:
    """np.float32(0.5) was refused as outside (0, 1], np.int64(3) and torch.tensor(3) as not integers in [0, 2^63);
    stop=5 was a raw TypeError; a string or a bool passed for a number or a flag was taken (or refused as its value)."""
    import numpy as np

    want = model.generate("Hi", max_new_tokens=4, top_p=float(np.float32(0.5)), seed=3, top_k=7, temperature=0.75,
                          logit_bias={11: 5.0})
    for top_p, seed, top_k, temperature, bias in [(np.float32(0.5), np.int64(3), np.int32(7), torch.tensor(0.75),
                                                   {np.int64(11): np.float16(5)}),
                                                  (torch.tensor(0.5, dtype=torch.float32), torch.tensor(3),
                                                   torch.tensor(7, dtype=torch.int16), np.float64(0.75),
                                                   [(torch.tensor(11), torch.tensor(5.0))])]:
        assert model.generate("Hi", max_new_tokens=4, top_p=top_p, seed=seed, top_k=top_k, temperature=temperature,
                              logit_bias=bias) == want
    settings = model.settings(seed=np.uint8(3), max_new_tokens=np.int64(2), top_p=np.float32(0.5), stop="x")
    assert (type(settings.seed), type(settings.max_new_tokens), type(settings.sampling.top_p)) == (int, int, float)
    assert settings.stop == ("x",)
    for kwargs, message in [
        (dict(seed=True), "seed must be an integer in [0, 2^63), got bool True"),  # seed 1, before
        (dict(seed=3.0), "seed must be an integer in [0, 2^63), got float 3.0"),
        (dict(seed=torch.tensor([3])), "seed must be an integer in [0, 2^63), got Tensor tensor([3])"),
        (dict(seed=np.int64(-1)), "seed must be an integer in [0, 2^63), got -1"),
        (dict(top_p="0.5"), "top_p must be in (0, 1] (1 disables it), got str '0.5'"),
        (dict(top_p=np.float32(2)), "top_p must be in (0, 1] (1 disables it), got 2.0"),
        (dict(top_k=2.5), "top_k must be an integer >= 0 (0 disables it), got float 2.5"),
        (dict(top_k=np.bool_(True)), "top_k must be an integer >= 0 (0 disables it), got bool np.True_"),
        (dict(max_new_tokens="4"), "max_new_tokens must be an integer >= 0, got str '4'"),
        (dict(stop=5), "stop must be a string or a list of strings, got int 5"),
        (dict(stop=b"x"), "stop must be a string or a list of strings, got bytes b'x'"),
        (dict(ignore_eos="yes"), "ignore_eos must be True or False, got str 'yes'"),
        (dict(ignore_eos=1), "ignore_eos must be True or False, got int 1"),
        (dict(logit_bias={5: "1"}), "logit_bias must map token ids to numbers in [-100, 100], got 5: str '1'"),
        (dict(logit_bias={"5": 1}), "logit_bias must map token ids to numbers in [-100, 100], got str '5': 1"),
        (dict(logit_bias={5: True}), "logit_bias must map token ids to numbers in [-100, 100], got 5: bool True"),
        (dict(logit_bias=5), "logit_bias must map token ids to numbers in [-100, 100], got int 5"),
    ]:
        with pytest.raises(GenerationError) as e:
            model.generate("Hi", **{"max_new_tokens": 2, **kwargs})
        assert str(e.value) == message


def test_top_k_larger_than_the_vocabulary_is_clamped(model: GPT2) -> None:
    big = model.generate("Hi", max_new_tokens=5, seed=3, top_k=10**6)
    assert big == model.generate("Hi", max_new_tokens=5, seed=3, top_k=0)


def test_max_new_tokens_zero_generates_nothing(model: GPT2) -> None:
    [c] = model.complete(["Hi"], max_new_tokens=0)
    assert (c.text, c.token_ids, c.finish_reason) == ("", [], "length")


# --- stop conditions ----------------------------------------------------------------------------------------------


def test_stop_string_ends_the_text_before_it(model: GPT2) -> None:
    full = model.generate("Hello, my dog is", max_new_tokens=30, temperature=0, ignore_eos=True)
    stop = full[12:16]
    [c] = model.complete(["Hello, my dog is"], max_new_tokens=30, temperature=0, ignore_eos=True, stop=[stop, "zzzzqq"])
    assert c.finish_reason == "stop"
    assert c.text == full[: full.find(stop)]
    streamed = "".join(model.stream("Hello, my dog is", max_new_tokens=30, temperature=0, ignore_eos=True, stop=stop))
    assert streamed == c.text


@pytest.fixture(scope="module")
def eos_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose head always prefers <|endoftext|>: ln_f outputs a multiple of wte[50256]."""
    def prefer_eos(t: dict) -> None:
        t["ln_f.weight"] = torch.zeros_like(t["ln_f.weight"])
        t["ln_f.bias"] = t["wte.weight"][50256] * 10

    return edited_copy(tiny_dir, tmp_path_factory.mktemp("eos"), prefer_eos)


def test_generation_stops_at_endoftext_unless_ignore_eos(eos_dir: Path) -> None:
    m = GPT2.from_pretrained(eos_dir)
    [c] = m.complete(["Hi"], max_new_tokens=10, temperature=0)
    assert (c.text, c.token_ids, c.finish_reason) == ("", [], "eos")
    [c] = m.complete(["Hi"], max_new_tokens=10, temperature=0, ignore_eos=True)
    assert c.finish_reason == "length" and len(c.token_ids) == 10 and 50256 not in c.token_ids


# --- context limit and prompts ------------------------------------------------------------------------------------


def test_generation_stops_at_the_context_unless_truncated_left(tiny_model: GPT2) -> None:
    """As llama.cpp and transformers do: a prompt that leaves room for fewer new tokens than asked generates up to the
    context and stops there ('length'); truncate left keeps room for all of them instead."""
    ids = list(range(1000, 1120))  # 120 tokens; tiny context is 128
    short = tiny_model.generation([ids], max_new_tokens=10, temperature=0, ignore_eos=True)
    [c] = short.run()
    # 120 + 9 - 1 = 128 positions: the 9th new token is the last that fits (it is never fed back)
    assert (len(c.token_ids), c.finish_reason, short.stats.context_limited) == (9, "length", 9)
    assert c.token_ids == tiny_model.generate_ids(ids, max_new_tokens=9, temperature=0, ignore_eos=True)
    too_long = list(range(1000, 1129))  # 129 tokens: the prompt alone does not fit
    with pytest.raises(GenerationError, match="the prompt of 129 tokens exceeds the context of 128 tokens; shorten it, "
                                              "or keep its last tokens with truncate left"):
        tiny_model.generation([too_long], max_new_tokens=1)
    run = tiny_model.generation([ids], max_new_tokens=10, truncate="left", temperature=0)
    [c] = run.run()
    # 119 + 10 fits: the 10th new token is never fed back, so positions 0..127 suffice
    assert run.stats.truncated_tokens == 1 and c.prompt_tokens == 119 and len(c.token_ids) == 10
    assert c.token_ids == tiny_model.generate_ids(ids[1:], max_new_tokens=10, temperature=0)


def test_a_full_context_prompt_can_still_produce_one_token(tiny_model: GPT2) -> None:
    ids = list(range(1000, 1128))  # exactly the 128-token context
    assert len(tiny_model.generate_ids(ids, max_new_tokens=1, temperature=0)) == 1
    assert int(tiny_model(torch.tensor([ids]))[0, -1].argmax()) == tiny_model.generate_ids(ids, max_new_tokens=1, temperature=0)[0]


def test_empty_prompt_starts_from_endoftext(model: GPT2) -> None:
    assert model.generate("", max_new_tokens=8, temperature=0) == model.tokenizer.decode(
        model.generate_ids([50256], max_new_tokens=8, temperature=0))


def test_endoftext_in_a_prompt_is_text_unless_allowed(model: GPT2) -> None:
    [plain] = model.complete(["a<|endoftext|>"], max_new_tokens=1)
    [special] = model.complete(["a<|endoftext|>"], max_new_tokens=1, allow_special=True)
    assert plain.prompt_tokens == 1 + len(model.tokenizer.encode("<|endoftext|>")) and special.prompt_tokens == 2


def test_logprobs_are_those_of_the_chosen_tokens(model: GPT2) -> None:
    prompt = model.tokenizer.encode("Hello, my")
    [c] = model.complete(["Hello, my"], max_new_tokens=3, temperature=0)
    log_probs = torch.log_softmax(model(torch.tensor([prompt + c.token_ids]))[0], -1)  # [T, V]
    expected = [log_probs[len(prompt) - 1 + i, t].item() for i, t in enumerate(c.token_ids)]
    assert c.logprobs == pytest.approx(expected, abs=1e-4)


# --- streaming text -----------------------------------------------------------------------------------------------


def test_incomplete_utf8_tail() -> None:
    emoji = "😀".encode()  # 4 bytes
    assert [incomplete_utf8_tail(emoji[:n]) for n in range(5)] == [0, 1, 2, 3, 0]
    assert incomplete_utf8_tail(b"abc") == 0 and incomplete_utf8_tail("é".encode()[:1]) == 1
    assert incomplete_utf8_tail(b"\x80\x80") == 0  # stray continuation bytes cannot be completed


def test_streaming_never_splits_a_character() -> None:
    from gpt2_engine import load_tokenizer

    tok = load_tokenizer()
    text = "Emoji 😀🤖 and 東京 ok"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # several tokens per multi-byte character
    d = Detokenizer(tok, ())
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.ready())
    pieces.append(d.finish())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stream_holds_back_a_possible_stop_string() -> None:
    from gpt2_engine import load_tokenizer

    tok = load_tokenizer()
    d = Detokenizer(tok, ("END",))
    out = []
    for t in tok.encode("abc EN"):
        d.add(t)
        out.append(d.ready())
    assert "".join(out) == "abc " and d.add(tok.encode("D")[0]) is True and d.finish() == ""


def test_stream_pieces_join_to_the_generated_text(model: GPT2) -> None:
    kwargs = dict(max_new_tokens=30, seed=11, temperature=1.0)
    assert "".join(model.stream("Zoë", **kwargs)) == model.generate("Zoë", **kwargs)


# --- the scheduler: continuous batching ----------------------------------------------------------------------------


def engine_loop(model: GPT2, slots: int) -> EngineLoop:
    return EngineLoop(Scheduler(model.config, model.tokenizer, slots=slots),
                      ModelRunner(model.weights, model.config, slots=slots))


def alone(model: GPT2, r: Request) -> list[int]:
    """The tokens a request gets with the engine to itself."""
    loop, out = engine_loop(model, 1), []
    loop.submit([r], tag="alone")
    for _ in range(100):  # bounded: a few steps each
        for outputs in loop.step():
            out += [e.token for _, e in outputs if e.token is not None]
        if loop.scheduler.idle:
            return out
    raise AssertionError("the loop did not finish")


def test_scheduler_outputs_do_not_depend_on_what_else_runs(model: GPT2) -> None:
    """Sequences that join mid-run, leave early and sample with different settings produce exactly the tokens they
    produce alone (row-invariant projections and head, per-row attention)."""
    enc = model.tokenizer.encode
    requests = [
        Request(enc("Hello, my dog is"), 30, SamplingParams(temperature=0), ignore_eos=True),
        Request(enc("def main():\n    print("), 12, SamplingParams(temperature=1.0, top_k=0, top_p=0.9), seed=3),
        Request(enc("Zoë's café — 東京 🤖"), 25, SamplingParams(temperature=0.7, repetition_penalty=1.3), seed=4),
        Request(enc("Once"), 8, SamplingParams(temperature=0, presence_penalty=1.0), ignore_eos=True),
    ]
    join_at = [0, 3, 3, 9]
    loop = engine_loop(model, 3)  # fewer slots than requests: one waits
    out: list[list[int]] = [[] for _ in requests]
    for step in range(1000):  # bounded: every request here finishes in well under 100 steps
        for i in [i for i, s in enumerate(join_at) if s == step]:
            loop.submit([requests[i]], tag=i)
        for outputs in loop.step():
            for seq, e in outputs:
                if e.token is not None:
                    out[seq.tag].append(e.token)
        if loop.scheduler.idle and step > max(join_at):
            break
    assert out == [alone(model, r) for r in requests]
    assert len(out[0]) == 30 and len(out[3]) == 8


def test_segments_that_join_a_pass_midway_get_the_same_bits(model: GPT2) -> None:
    """A prompt handed to a pass before block i (after running blocks 0..i-1 alone) gets the logits and writes the
    cache entries it gets when it runs in the pass from the start."""
    enc, cfg = model.tokenizer.encode, model.config
    running = [Segment(0, 0, enc("Hello, my dog is")), Segment(2, 0, enc("Once"))]
    late = [Segment(1, 0, enc("def main():\n    print(")), Segment(3, 0, enc("Zoë"))]
    ref_cache = KVCache.allocate(cfg, 4, 32)
    ref = run_pass(model.weights, cfg, running + late, ref_cache)
    for layer in (0, 1, cfg.n_layer // 2, cfg.n_layer - 1):
        cache = KVCache.allocate(cfg, 4, 32)
        p = Pass(model.weights, cfg, cache, running)
        rows = []
        while not p.done:
            if p.layer == layer:
                p.add(late)
            rows.append(p.rows)
            p.run_block()
        assert torch.equal(p.logits(), ref), layer
        assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v), layer
        n, more = (sum(len(s.ids) for s in segs) for segs in (running, late))
        assert rows == [n if i < layer else n + more for i in range(cfg.n_layer)]


def test_requests_that_arrive_mid_pass_join_it(model: GPT2) -> None:
    """A request handed to the loop while the first half of a pass runs gets its first token from that pass, and
    exactly the tokens it gets alone; one that arrives later waits for the next pass."""
    enc = model.tokenizer.encode
    greedy = SamplingParams(temperature=0)
    first = Request(enc("Hello, my dog is"), 6, greedy, ignore_eos=True)
    early = Request(enc("def main():"), 5, SamplingParams(temperature=1.0, top_k=0, top_p=0.9), seed=3)
    late = Request(enc("Once upon a time"), 4, greedy, ignore_eos=True)
    loop = engine_loop(model, 3)
    got: dict[str, list[tuple[int, int]]] = {"first": [], "early": [], "late": []}
    half = model.config.n_layer // 2
    loop.submit([first], tag="first")
    for step in range(20):  # bounded: everything finishes in 7 steps
        between = 0  # the loop yields an empty list before each block of its last pass
        for outputs in loop.step():
            for seq, e in outputs:
                if e.token is not None:
                    got[seq.tag].append((step, e.token))
            if not outputs and step == 1:
                between += 1
                if between == 2:  # before block 1: joins this pass
                    loop.submit([early], tag="early")
                if between == half + 1:  # before block `half`: too late for this pass
                    loop.submit([late], tag="late")
        if loop.scheduler.idle:
            break
    assert [s for s, _ in got["first"]] == list(range(6))
    assert [s for s, _ in got["early"]] == list(range(1, 6))  # its first token from the pass it joined
    assert [s for s, _ in got["late"]] == list(range(2, 6))  # past half the blocks: the next pass
    for name, r in (("first", first), ("early", early), ("late", late)):
        assert [t for _, t in got[name]] == alone(model, r), name


@pytest.mark.parametrize("prompt, message", [
    (b"hi", "prompt: got bytes; decode it to a string first"),  # bytes iterate as ints: it ran as token ids [104, 105]
    (None, "prompt must be a string, a list of strings, a list of token ids or a list of such lists; got NoneType"),
    ([], "prompt must not be an empty list"),
])
def test_a_prompt_that_is_not_text_or_token_ids_is_refused(tiny_model: GPT2, prompt: object, message: str) -> None:
    with pytest.raises(GenerationError, match="^" + re.escape(message) + "$"):
        tiny_model.generate(prompt, max_new_tokens=2)

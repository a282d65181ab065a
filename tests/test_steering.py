"""Steering: directions added and SAE features set while the model generates, exact with the engine's machinery.

The reference is TransformerLens's run_with_hooks on the trained fixture, recomputing the whole sequence for every
new token (no cache), with the same edit at the same hook: the engine's greedy ids must equal it for hooks before,
inside and after blocks, for plain vectors, SAE decoder rows (SAELens's SAEs on the TransformerLens model each was
trained on) and clamped SAE latents. Then the machinery: the KV cache (against the engine's own recompute),
continuous batching (steered and unsteered rows in one pass, each equal to its run alone), the prefix cache (keyed
by the steering), speculative decoding, every weight format, the command line, the server and lm-eval.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
from pathlib import Path

import httpx
import pytest
import torch
from conftest import THREADS, cli, gpt2_serve

from gpt2_engine import GPT2, SAE, Steering, SteeringError
from gpt2_engine.interp.sae import presentation
from gpt2_engine.interp.spec import MAX_EDIT, hook_shape
from gpt2_engine.interp.steering import apply
from gpt2_engine.runtime.loop import EngineLoop
from gpt2_engine.runtime.prefix import PrefixCache
from gpt2_engine.runtime.requests import GenerationSettings, build_requests
from gpt2_engine.runtime.runner import ModelRunner
from gpt2_engine.runtime.sampling import SamplingParams
from gpt2_engine.runtime.scheduler import Scheduler

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PROMPTS = ["Return the number of", "If the file", "The default value of the"]
NEW = 16


def direction(model: GPT2, word: str) -> torch.Tensor:
    """[C]: the unembedding row of a word's first token, a direction that makes the model say it."""
    return model.weights.wte[model.tokenizer.encode(word)[0]].float().clone()


def random_vector(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def cases(model: GPT2) -> dict[str, Steering]:
    """Edits before, between, inside and after the blocks, on every kind of hook point and position set. The trained
    fixture's residual stream is ~500 long (its position embeddings), its normalized one ~16, a wte row ~0.5: the
    coefficients make each edit change the text."""
    C, nh, hs = model.config.n_embd, model.config.n_head, model.config.head_size
    return {
        "embed": Steering("hook_embed", direction(model, " file"), 0.6),
        "resid_pre": Steering("blocks.1.hook_resid_pre", direction(model, " file"), 400.0),
        "mlp_post": Steering("blocks.2.mlp.hook_post", random_vector((4 * C,), 1), 10.0),
        "attn_v_head": Steering("blocks.1.attn.hook_v", random_vector((hs,), 2), 6.0, head=2),
        "resid_post_generated": Steering("blocks.3.hook_resid_post", direction(model, " string"), 600.0, "generated"),
        "ln_final_prompt": Steering("ln_final.hook_normalized", direction(model, " list"), 20.0, "prompt"),
        "z_all_heads": Steering("blocks.0.attn.hook_z", random_vector((nh, hs), 3), 8.0),
    }


def rows_mask(positions: str, T: int, prompt_len: int) -> torch.Tensor:
    pos = torch.arange(T)
    return {"all": pos >= 0, "prompt": pos < prompt_len, "generated": pos >= prompt_len}[positions]


def tl_edit(s: Steering, prompt_len: int, sae_ref=None):
    """The edit as a TransformerLens hook on the whole sequence [1, T, ...] (sae_ref: sae-lens's SAE, for clamps)."""
    def hook(a: torch.Tensor, hook=None) -> torch.Tensor:
        a = a.clone()
        mask = rows_mask(s.positions, a.shape[1], prompt_len)
        part = a[:, mask] if s.head is None else a[:, mask, s.head]
        if s.action == "clamp":  # sae-lens reshapes hook_z itself, and its layer_norm keeps encode's statistics
            f = sae_ref.encode(part)  # for the next decode only, so each decode follows an encode
            g = f.clone()
            g[..., s.feature] = s.value
            clamped = sae_ref.decode(g)
            sae_ref.encode(part)
            edited = part + clamped - sae_ref.decode(f)
        else:
            edited = part + s.coef * s.vector.view(part.shape[2:])
        if s.head is None:
            a[:, mask] = edited
        else:
            a[:, mask, s.head] = edited
        return a
    return hook


def tl_greedy(tl, prompt: list[int], hooks: list[tuple[str, object]], n: int = NEW, eot: int = 50256) -> list[int]:
    """Greedy ids by TransformerLens, the whole sequence recomputed for every token (no cache), up to <|endoftext|>
    (which the engine's ids leave out)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            token = int(tl.run_with_hooks(torch.tensor([seq]), fwd_hooks=hooks)[0, -1].argmax())
            if token == eot:
                break
            seq.append(token)
    return seq[len(prompt):]


# Decoding with the KV cache against recomputing the whole sequence, as a fraction of the largest logit: the plain
# engine's own gap is up to 1.6e-5 on an AVX2-only CPU (its decode kernels sum in another order than MKL's GEMM; ~1e-6
# with AVX-512), and steering must add nothing to it.
CACHE_TOL = 3e-5


def engine_recompute(model: GPT2, prompt: list[int], tokens: list[int],
                     steering: list[Steering]) -> tuple[torch.Tensor, float, list[int]]:
    """[n] log p(token) of each generated token, by the engine's forward over the whole sequence (no cache) with
    each edit as a run_with_hooks hook; the largest |logit| of those rows; and each row's argmax."""
    seq = torch.tensor([prompt + tokens])
    L = len(prompt)
    hooks = {}
    for s in steering:
        def hook(a: torch.Tensor, name: str, s=s) -> torch.Tensor:
            rows = a.reshape(-1, *a.shape[2:])
            mask = rows_mask(s.positions, a.shape[1], L)
            out = rows.clone()
            out[mask] = apply(s, rows[mask], model.weights, model.config)
            return out.view(a.shape)
        hooks[s.hook] = hook
    with torch.no_grad():
        logits = model.run_with_hooks(seq, hooks)[0, L - 1 : -1]  # [n, V]
    return (logits.log_softmax(-1).gather(-1, seq[0, L:, None])[:, 0], float(logits.abs().max()),
            logits.argmax(-1).tolist())


@pytest.fixture(scope="module")
def tl(trained_hf_model):
    import sae_reference as ref
    pytest.importorskip("transformer_lens", reason="TransformerLens (the test extra) is the reference")
    return ref.tl_model(trained_hf_model)


@pytest.mark.parametrize("name", ["embed", "resid_pre", "mlp_post", "attn_v_head", "resid_post_generated",
                                  "ln_final_prompt", "z_all_heads"])
def test_greedy_ids_equal_transformer_lens_recompute_and_the_cache_equals_a_recompute(name, trained_model, tl) -> None:
    s = cases(trained_model)[name]
    changed = 0
    for prompt in PROMPTS:
        ids = trained_model.tokenizer.encode(prompt)
        got = trained_model.complete([ids], max_new_tokens=NEW, temperature=0, steering=[s])[0]
        want = tl_greedy(tl, ids, [(s.hook, tl_edit(s, len(ids)))])
        assert got.token_ids == want, (name, prompt)
        changed += got.token_ids != trained_model.generate_ids(ids, max_new_tokens=NEW, temperature=0)
        # decoding with the KV cache = the whole sequence recomputed with the same steering
        recomputed, scale, _ = engine_recompute(trained_model, ids, got.token_ids, [s])
        assert (torch.tensor(got.logprobs) - recomputed).abs().max() <= CACHE_TOL * scale
    assert changed >= 1, f"{name}: the steering changed no prompt's text"  # the check has teeth


@pytest.fixture(scope="module")
def saes(saes_dir: Path):
    import sae_reference as ref
    pytest.importorskip("sae_lens", reason="sae-lens (the test extra) is the reference")
    return saes_dir, ref.load(saes_dir)


def strong_feature(sae: SAE, model: GPT2) -> tuple[int, float]:
    """A feature that fires on the prompts, and its largest activation there."""
    ids = torch.tensor([model.tokenizer.encode(" ".join(PROMPTS))])
    _, cache = model.run_with_cache_with_saes(ids, [sae], names=[f"{sae.hook_name}.hook_sae_acts_post"])
    f = cache[f"{sae.hook_name}.hook_sae_acts_post"].reshape(-1, sae.d_sae)
    top = f.amax(0)
    return int(top.argmax()), float(top.max())


@pytest.mark.parametrize("spec_name,how,strength", [
    ("standard-resid", "add", 8), ("gated-ln", "add", 8), ("head", "add", 16), ("standard-lnf", "add", 8),
    ("topk-mlp", "clamp", 6), ("jumprelu-resid", "clamp", 6), ("z", "clamp", 6)])
def test_sae_steering_equals_transformer_lens_on_the_saes_own_model(spec_name, how, strength, saes, trained_model,
                                                                    trained_hf_model) -> None:
    """from_sae adds coef x W_dec[feature] where the SAE's TransformerLens model (its processing options) shows the
    activation; clamp sets a latent by adding decode(clamped) - decode(original). Both against TransformerLens with
    the same edit, recomputed token by token."""
    import sae_reference as ref

    directory, references = saes
    spec = next(s for s in ref.SPECS if s.name == spec_name)
    sae = SAE.load(directory / spec.name)
    feature, top = strong_feature(sae, trained_model)
    if how == "add":  # `strength` x the feature's largest activation: enough to change the text
        s = Steering.from_sae(sae, feature, coef=strength * max(top, 1.0))
    else:
        s = Steering.clamp(sae, feature, value=strength * top)
    tl = ref.tl_model(trained_hf_model, **spec.options)
    sae_ref = references[spec.name]
    changed = 0
    for prompt in PROMPTS:
        ids = trained_model.tokenizer.encode(prompt)
        got = trained_model.generate_ids(ids, max_new_tokens=NEW, temperature=0, steering=[s])
        want = tl_greedy(tl, ids, [(s.hook, tl_edit(s, len(ids), sae_ref))])
        assert got == want, (spec_name, prompt)
        changed += got != trained_model.generate_ids(ids, max_new_tokens=NEW, temperature=0)
    assert changed >= 1


def test_a_clamp_adds_decode_clamped_minus_decode_original_and_nothing_else(saes, trained_model) -> None:
    """BioNeMo's recipe, computed literally with the SAE's own encode and decode in its presented space and lifted
    back: a clamp changes the activation by exactly that (the SAE's reconstruction error cancels), and a one-head SAE
    leaves the other heads' bits alone."""
    directory, _ = saes
    w, cfg = trained_model.weights, trained_model.config
    ids = torch.tensor([trained_model.tokenizer.encode(" ".join(PROMPTS))])
    for name in ("standard-resid", "topk-mlp", "gated-ln", "head"):
        sae = SAE.load(directory / name)
        feature, top = strong_feature(sae, trained_model)
        s = Steering.clamp(sae, feature, 3.0 * top)
        _, cache = trained_model.run_with_cache(ids, [sae.hook_name])
        a = cache[sae.hook_name][0]  # [T, *row]
        edited = apply(s, a, w, cfg)
        affine = presentation(sae.config, cfg, w, a)
        p = affine.present(a)
        head = sae.config.hook_head_index
        x = p[:, head] if head is not None else sae.flatten(p)  # [T, d_in]
        f = sae.encode(x)
        g = f.clone()
        g[:, feature] = 3.0 * top
        d = sae.decode(g, x) - sae.decode(f, x)  # [T, d_in]
        full = torch.zeros_like(p)
        if head is not None:
            full[:, head] = d
        else:
            full = d.view(p.shape)
        want = a + affine.restore(full) - affine.restore(torch.zeros_like(full))
        scale = a.abs().max()
        assert (edited - want).abs().max() <= 1e-5 * scale, name
        assert (edited - a).abs().max() > 1e-3 * scale, name  # it did change the activation
        if head is not None:
            others = [h for h in range(cfg.n_head) if h != head]
            assert torch.equal(edited[:, others], a[:, others])


def run_requests(model: GPT2, requests: list, slots: int, record: list | None = None) -> list[tuple[list[int], list[float]]]:
    """The requests through one engine loop (slots at once): each one's token ids and logprobs. `record`: each pass's
    segments are appended to it."""
    max_len = max(len(r.prompt) + r.max_new_tokens for r in requests)
    runner = ModelRunner(model.weights, model.config, slots=slots, max_len=max_len)
    if record is not None:
        opened = runner.open
        runner.open = lambda segments: (record.append(list(segments)), opened(segments))[1]
    loop = EngineLoop(Scheduler(model.config, model.tokenizer, slots=slots, max_len=max_len), runner)
    loop.submit(requests, tag=None)
    loop.intake()
    seqs = list(loop.scheduler.waiting)
    logprobs: list[list[float]] = [[] for _ in requests]
    while not loop.scheduler.idle:
        for outputs in loop.step():
            for seq, e in outputs:
                assert e.finish_reason != "error", e.error
                if e.token is not None and e.token != model.tokenizer.eot_id:
                    logprobs[seq.index].append(e.logprob)
    return [(seq.tokens, logprobs[i]) for i, seq in enumerate(seqs)]


def test_steered_and_unsteered_rows_share_passes_and_each_equals_its_run_alone(trained_model, saes) -> None:
    directory, _ = saes
    sae = SAE.load(directory / "topk-mlp")
    feature, top = strong_feature(sae, trained_model)
    c = cases(trained_model)
    steerings = [(), (c["resid_pre"],), (c["mlp_post"], c["ln_final_prompt"]), (Steering.clamp(sae, feature, 5 * top),),
                 (c["attn_v_head"],), (c["resid_post_generated"],)]
    requests = []
    for i, steering in enumerate(steerings):
        settings = GenerationSettings(max_new_tokens=12, sampling=SamplingParams(temperature=0.0), seed=1,
                                      steering=steering)
        prompt = trained_model.tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        requests += build_requests([prompt], settings, trained_model.config, trained_model.tokenizer.eot_id).requests
    passes: list = []
    together = run_requests(trained_model, requests, slots=len(requests), record=passes)
    alone = [run_requests(trained_model, [r], slots=1)[0] for r in requests]
    assert together == alone  # token ids and logprobs, to the bit
    mixed = [p for p in passes if any(s.steering for s in p) and any(not s.steering for s in p)]
    assert mixed and max(len({s.steering for s in p}) for p in passes) == len(steerings)
    plain = trained_model.complete([requests[0].prompt], max_new_tokens=12, temperature=0)[0]
    assert together[0] == (plain.token_ids, plain.logprobs)


def test_the_prefix_cache_never_serves_keys_and_values_computed_under_other_steering(trained_model) -> None:
    cfg, w = trained_model.config, trained_model.weights
    prompt = trained_model.tokenizer.encode(" ".join(PROMPTS * 3))
    assert len(prompt) >= 32
    s = cases(trained_model)["resid_pre"]
    prefix = PrefixCache(cfg, 8)
    runner = ModelRunner(w, cfg, slots=1, max_len=len(prompt), prefix=prefix)
    fresh = ModelRunner(w, cfg, slots=1, max_len=len(prompt))
    steered = runner.prefill(0, prompt, steering=(s,))
    assert steered.cached == 0
    plain = runner.prefill(0, prompt)  # same tokens, no steering: nothing of the steered run is reused
    assert plain.cached == 0
    assert torch.equal(plain.logits, fresh.prefill(0, prompt).logits)
    again = runner.prefill(0, prompt, steering=(s,))  # the same steering reuses its own blocks
    assert again.cached > 0
    assert (again.logits - fresh.prefill(0, prompt, steering=(s,)).logits).abs().max() <= 1e-5 * steered.logits.abs().max()
    other = runner.prefill(0, prompt, steering=(Steering(s.hook, s.vector, 2 * s.coef),))  # another coefficient
    assert other.cached == 0
    # steering of generated tokens only leaves a prompt's keys and values the plain model's: they are shared
    later = runner.prefill(0, prompt, steering=(cases(trained_model)["resid_post_generated"],))
    assert later.cached > 0 and torch.equal(later.logits, runner.prefill(0, prompt).logits)


@pytest.mark.parametrize("drafter", ["int4", "ngram"])
def test_speculation_under_steering_equals_plain_steered_decoding(drafter, trained_model) -> None:
    c = cases(trained_model)
    for steering in ([c["resid_pre"]], [c["mlp_post"], c["resid_post_generated"]]):
        for prompt in PROMPTS:
            ids = trained_model.tokenizer.encode(prompt)
            plain = trained_model.generate_ids(ids, max_new_tokens=24, temperature=0, steering=steering)
            run = trained_model.generation([ids], max_new_tokens=24, temperature=0, steering=steering,
                                           speculate=drafter, draft_tokens=3)
            assert run.run()[0].token_ids == plain
            assert run.stats.drafted > 0


def test_the_int4_drafter_is_steered_too(trained_model, trained_dir) -> None:
    """A self-drafter runs the sequence's steering: its drafts are the int4 model's own steered greedy continuation
    (what keeps it agreeing with a steered target), not the unsteered one."""
    from gpt2_engine.runtime.plan import DraftAsk

    s = Steering("blocks.1.hook_resid_pre", direction(trained_model, " file"), 200.0)  # changes the text by token 3
    ids = trained_model.tokenizer.encode(PROMPTS[0])
    n = 8
    drafter = trained_model.speculation("int4").drafter(1, len(ids) + n)
    greedy = SamplingParams(temperature=0)

    def drafts(steering: tuple) -> list[int]:
        ask = DraftAsk(0, ids, n, greedy, torch.Generator(), (trained_model.tokenizer.eot_id,), steering, len(ids))
        return drafter.propose([ask])[0].tokens

    int4 = GPT2.from_pretrained(trained_dir, quantize="int4")
    steered = int4.generate_ids(ids, max_new_tokens=n, temperature=0, steering=[s], ignore_eos=True)
    assert drafts((s,)) == steered
    assert drafts(()) == int4.generate_ids(ids, max_new_tokens=n, temperature=0, ignore_eos=True) != steered


@pytest.mark.parametrize("variant", [{"dtype": "bfloat16"}, {"quantize": "int8"}, {"quantize": "int4"}])
def test_every_weight_format_steers_exactly_with_the_cache(variant, trained_dir) -> None:
    model = GPT2.from_pretrained(trained_dir, **variant)
    c = cases(model)
    for s in (c["resid_pre"], c["mlp_post"], c["ln_final_prompt"]):
        ids = model.tokenizer.encode(PROMPTS[1])
        got = model.complete([ids], max_new_tokens=NEW, temperature=0, steering=[s])[0]
        recomputed, scale, argmax = engine_recompute(model, ids, got.token_ids, [s])
        # int8 / int4 round each row's activations to int8, where a 1e-5 difference of the residual can move a
        # value across a rounding step: measured up to 2.7e-4 of the largest logit (the plain int8 model's own gap:
        # 5e-5); bfloat16 keeps float32 activations in decode and measured 1.8e-5
        tol = 1e-3 if "quantize" in variant else CACHE_TOL
        assert (torch.tensor(got.logprobs) - recomputed).abs().max() <= tol * scale, s
        assert argmax == got.token_ids  # every step's greedy choice, recomputed without the cache


def test_scoring_under_steering_is_the_steered_forward(trained_model) -> None:
    s = cases(trained_model)["mlp_post"]
    text = " ".join(PROMPTS)
    ids = torch.tensor([[trained_model.tokenizer.eot_id, *trained_model.tokenizer.encode(text)]])
    want = trained_model.token_logprobs(ids, steering=[s]).sum()
    plain = trained_model.score([text])[0]
    for prefix in (None, 8):
        got = trained_model.score([text], steering=[s], prefix_cache_mb=prefix)[0]
        assert abs(got.nll + float(want)) <= 1e-4 and abs(got.nll - plain.nll) > 1e-3
    with pytest.raises(SteeringError, match="'generated' reach no token of a scored text"):
        trained_model.score([text], steering=[cases(trained_model)["resid_post_generated"]])


def test_steering_errors_are_one_line(trained_model, tmp_path: Path) -> None:
    C = trained_model.config.n_embd
    bad = [
        (Steering("blocks.9.hook_resid_pre", torch.ones(C)), "not a hook point of this model"),
        (Steering("blocks.1.attn.hook_pattern", torch.ones(C)), "is not one row per token"),
        (Steering("blocks.1.hook_resid_pre", torch.ones(C + 1)), f"that hook is {C} wide"),
        (Steering("blocks.1.mlp.hook_pre", torch.ones(C)), f"that hook is {4 * C} wide"),
        (Steering("blocks.1.hook_resid_pre", torch.ones(C), head=0), "only q/k/v/z hook points have heads"),
        (Steering("blocks.1.hook_resid_pre", torch.ones(C // 8, 8)), rf"shape \[{C // 8}, 8\]; expected \[{C}\]"),
        (Steering("blocks.1.attn.hook_q", torch.ones(C // 8, 8)), rf"expected \[{trained_model.config.n_head}, "),
    ]
    for s, fragment in bad:
        with pytest.raises(SteeringError, match=fragment) as e:
            trained_model.generate("The", max_new_tokens=2, steering=[s])
        assert "\n" not in str(e.value)
    v = torch.randn(C, generator=torch.Generator().manual_seed(0))  # a row's own shape, flat or with leading 1s
    nh = trained_model.config.n_head
    for hook, shaped in [("blocks.1.hook_resid_pre", v.view(1, 1, C)), ("blocks.1.attn.hook_q", v.view(nh, -1))]:
        got = [trained_model.generate("Once upon a time there was", max_new_tokens=6, temperature=0, steering=[Steering(hook, t, coef=40.0)])
               for t in (shaped, v)]
        assert got[0] == got[1] != trained_model.generate("Once upon a time there was", max_new_tokens=6, temperature=0)
    with pytest.raises(SteeringError, match="positions must be one of"):
        Steering("hook_embed", torch.ones(C), positions="later")
    with pytest.raises(SteeringError, match="expected finite values"):
        Steering("hook_embed", torch.full((C,), float("nan")))
    with pytest.raises(SteeringError, match="expected gpt2_engine.Steering"):
        trained_model.generate("The", max_new_tokens=2, steering=["blocks.1.hook_resid_pre"])
    # files: read without running code
    torch.save({"a": torch.ones(C), "b": torch.ones(C)}, tmp_path / "two.pt")
    with pytest.raises(SteeringError, match="expected one tensor, found 2"):
        Steering.load(tmp_path / "two.pt", "hook_embed")

    class Evil:
        def __reduce__(self):
            return (print, ("ran code",))

    torch.save({"v": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(SteeringError, match="not a readable .pt file"):
        Steering.load(tmp_path / "evil.pt", "hook_embed")
    import numpy as np
    np.save(tmp_path / "v.npy", np.ones(C, dtype=np.float32))
    assert torch.equal(Steering.load(tmp_path / "v.npy", "hook_embed").vector, torch.ones(C))


def test_an_edit_float32_cannot_carry_is_refused_and_the_largest_allowed_keeps_the_logits_finite(trained_model,
                                                                                                  saes) -> None:
    """coef 1e308 once made NaN logits (the server's 500, where inf got a 400): an edit past MAX_EDIT is refused when
    it is made, and one of MAX_EDIT in every value, at each kind of hook (a residual, the MLP's widest activations,
    a head's values), still gives finite log-probabilities."""
    config = trained_model.config
    ids = torch.tensor([[trained_model.tokenizer.eot_id, *trained_model.tokenizer.encode(PROMPTS[0])]])
    for hook in ("blocks.0.hook_resid_pre", "blocks.1.mlp.hook_pre", "blocks.1.mlp.hook_post", "blocks.2.attn.hook_v",
                 "blocks.3.hook_resid_post"):
        ones = torch.ones(math.prod(hook_shape(hook, config)))
        logprobs = trained_model.token_logprobs(ids, steering=[Steering(hook, ones, MAX_EDIT)])
        assert bool(torch.isfinite(logprobs).all()), hook
        for coef in (-1.01 * MAX_EDIT, 1e308):
            with pytest.raises(SteeringError, match=re.escape(f"adds values up to {abs(coef):.3g}; at most 1e+12 keeps")):
                Steering(hook, ones, coef)
        with pytest.raises(SteeringError, match=r"value 1e\+308 adds values up to 1e\+308"):
            Steering.project(hook, ones, 1e308)
    sae = SAE.load(saes[0] / "topk-mlp")
    with pytest.raises(SteeringError, match=r"clamp 1e\+308 adds values up to"):
        Steering.clamp(sae, 0, 1e308)
    with pytest.raises(SteeringError, match=r"coef 1e\+308 adds values up to"):
        Steering.from_sae(sae, 0, 1e308)


def test_an_sae_feature_may_be_a_numpy_or_torch_integer_and_any_other_type_is_named(saes_dir: Path) -> None:
    """np.int64(3) was refused as outside "this SAE's features are 0..1023"."""
    import numpy as np

    sae = SAE.load(saes_dir / "topk-mlp")
    want = Steering.from_sae(sae, 3, 2.0)
    for given in (np.int64(3), np.uint16(3), torch.tensor(3), np.array(3)):
        for s in (Steering.from_sae(sae, given, 2.0), Steering.clamp(sae, given, 1.0)):
            assert type(s.feature) is int and s.feature == 3
        assert torch.equal(Steering.from_sae(sae, given, 2.0).vector, want.vector)
    last = sae.d_sae - 1
    for given, message in [(True, f"steering feature: expected an integer (this SAE's features are 0..{last}), got "
                                  "bool True"),
                           ("3", f"steering feature: expected an integer (this SAE's features are 0..{last}), got "
                                 "str '3'"),
                           (3.0, f"steering feature: expected an integer (this SAE's features are 0..{last}), got "
                                 "float 3.0"),
                           (torch.tensor([3]), f"steering feature: expected an integer (this SAE's features are "
                                               f"0..{last}), got Tensor tensor([3])"),
                           (np.int64(last + 1), f"steering feature {last + 1}: this SAE's features are 0..{last}")]:
        with pytest.raises(SteeringError) as e:
            Steering.from_sae(sae, given)
        assert str(e.value) == message


def test_a_coef_or_value_may_be_a_numpy_or_torch_number_and_a_bool_or_text_is_named(saes_dir: Path) -> None:
    """The thirteenth attack: coef=np.float32(2.0) was refused as "must be a finite number, got np.float32(2.0)",
    naming a valid value as the fault, while the feature took numpy's integers."""
    import numpy as np

    sae = SAE.load(saes_dir / "topk-mlp")
    want = Steering.from_sae(sae, 3, 2.0)
    for given in (np.float32(2.0), np.float64(2.0), np.int64(2), torch.tensor(2.0)):
        s = Steering.from_sae(sae, 3, given)
        assert type(s.coef) is float and s.coef == 2.0 and s.key == want.key
        assert Steering.clamp(sae, 3, given).value == 2.0
    for given, shown in [(True, "bool True"), ("2", "str '2'"), (np.float32("nan"), "float32 np.float32(nan)"),
                         (torch.tensor([2.0]), "Tensor tensor([2.])")]:
        with pytest.raises(SteeringError, match=f"^steering coef must be a finite number, got {re.escape(shown)}$"):
            Steering.from_sae(sae, 3, given)


def first_json(out: str) -> dict:
    """The first JSON line of what a command printed."""
    return json.loads(out.splitlines()[0])


def test_gpt2_generate_and_score_steer(trained_dir: Path, trained_model, tmp_path: Path, saes, capsys) -> None:
    directory, _ = saes
    s = cases(trained_model)["resid_pre"]
    torch.save(s.vector, tmp_path / "dir.pt")
    prompt = PROMPTS[0]
    want = trained_model.generate(prompt, max_new_tokens=NEW, temperature=0, steering=[s])
    code, out = cli("generate", prompt, "--weights", str(trained_dir), "-n", str(NEW), "--temperature", "0",
                    "--steer", f"vector={tmp_path / 'dir.pt'},hook={s.hook},coef={s.coef}", "--json")
    assert code == 0 and first_json(capsys.readouterr().out)["text"] == want
    sae = SAE.load(directory / "standard-resid")
    feature, top = strong_feature(sae, trained_model)
    want = trained_model.generate(prompt, max_new_tokens=NEW, temperature=0,
                                  steering=[Steering.clamp(sae, feature, 5 * top)])
    code, out = cli("generate", prompt, "--weights", str(trained_dir), "-n", str(NEW), "--temperature", "0",
                    "--steer", f"sae={directory / 'standard-resid'},feature={feature},clamp={5 * top!r}", "--json")
    assert code == 0 and first_json(capsys.readouterr().out)["text"] == want
    (tmp_path / "doc.txt").write_text(" ".join(PROMPTS), encoding="utf-8")
    code, out = cli("score", str(tmp_path / "doc.txt"), "--weights", str(trained_dir), "--json",
                    "--steer", f"vector={tmp_path / 'dir.pt'},hook={s.hook},coef={s.coef}")
    assert code == 0
    got = first_json(capsys.readouterr().out)
    assert abs(got["documents"][0]["nll"] - trained_model.score([" ".join(PROMPTS)], steering=[s])[0].nll) <= 1e-4
    for spec, fragment in [("sae=nowhere,feature=1,coef=2", "no such file or directory"),
                           (f"vector={tmp_path / 'dir.pt'},coef=2", "vector= needs hook=HOOK"),
                           (f"vector={tmp_path / 'dir.pt'},hook={s.hook},coef=two", "coef must be a number"),
                           ("feature=3", "give one of sae= or vector="),
                           ("colour=red", "unknown field 'colour'"),
                           ("junk", "expected key=value fields")]:
        code, out = cli("generate", prompt, "--weights", str(trained_dir), "-n", "2", "--steer", spec)
        assert code == 2 and fragment in out and "Traceback" not in out, (spec, out)
    with pytest.raises(SystemExit):
        cli("generate", "--help")
    assert "sae=SAE,feature=N" in " ".join(capsys.readouterr().out.split())


def test_gpt2_serve_steers_each_request_and_mixed_requests_equal_their_alone_outputs(trained_dir: Path, trained_model,
                                                                                     saes, tmp_path: Path) -> None:
    directory, _ = saes
    c = cases(trained_model)
    torch.save(c["resid_pre"].vector, tmp_path / "file.pt")
    sae = SAE.load(directory / "topk-mlp")
    feature, top = strong_feature(sae, trained_model)
    bodies = [
        {"prompt": PROMPTS[0]},
        {"prompt": PROMPTS[0], "steering": [{"vector": "file", "hook": c["resid_pre"].hook, "coef": c["resid_pre"].coef}]},
        {"prompt": PROMPTS[1], "steering": [{"sae": "mlp", "feature": feature, "clamp": 5 * top}]},
        {"prompt": PROMPTS[2], "steering": [{"sae": "mlp", "feature": feature, "coef": 3 * top, "positions": "generated"}]},
        {"prompt": PROMPTS[1]},
    ]
    # past <|endoftext|>: a fixture trained on another CPU can end a prompt's text after one token, which no edit
    # changes
    expected = [
        trained_model.generate(PROMPTS[0], max_new_tokens=NEW, temperature=0, ignore_eos=True),
        trained_model.generate(PROMPTS[0], max_new_tokens=NEW, temperature=0, ignore_eos=True,
                               steering=[c["resid_pre"]]),
        trained_model.generate(PROMPTS[1], max_new_tokens=NEW, temperature=0, ignore_eos=True,
                               steering=[Steering.clamp(sae, feature, 5 * top)]),
        trained_model.generate(PROMPTS[2], max_new_tokens=NEW, temperature=0, ignore_eos=True,
                               steering=[Steering.from_sae(sae, feature, 3 * top, "generated")]),
        trained_model.generate(PROMPTS[1], max_new_tokens=NEW, temperature=0, ignore_eos=True),
    ]
    assert len(set(expected)) == len(expected)
    with gpt2_serve("--weights", str(trained_dir), "--parallel", "8", "--threads", str(THREADS),
                    "--sae", f"mlp={directory / 'topk-mlp'}", "--steering-vector", f"file={tmp_path / 'file.pt'}") as (url, _):
        def run(body: dict) -> str:
            r = httpx.post(f"{url}/v1/completions", timeout=120,
                           json={"max_tokens": NEW, "temperature": 0, "ignore_eos": True, **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        alone = [run(b) for b in bodies]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(run, bodies * 2))
        assert alone == expected and together == expected * 2
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "steering": [{"sae": "mlp", "feature": feature, "coef": 1.0}]})
        assert chat.status_code == 200
        listed = httpx.get(f"{url}/v1/steering", timeout=10).json()
        assert listed["saes"] == [{"name": "mlp", "hook": sae.hook_name, "d_sae": sae.d_sae}]
        assert listed["vectors"] == [{"name": "file", "size": trained_model.config.n_embd}]
        for steering, fragment in [([{"sae": "nope", "feature": 1, "coef": 1}], "no SAE named 'nope'"),
                                   ([{"sae": "mlp", "feature": sae.d_sae, "coef": 1}], "features are 0.."),
                                   ([{"vector": "file", "coef": 1}], "needs hook=HOOK"),
                                   ([{"vector": "file", "hook": "blocks.1.mlp.hook_pre"}], "wide"),
                                   ([{"vector": "file", "hook": c["resid_pre"].hook, "coef": 1e308}], "at most 1e+12"),
                                   # JSON's types, as the twelfth attack found "3" taken for feature 3
                                   ([{"sae": "mlp", "feature": "3", "coef": 1}],
                                    'steering[0].feature: expected an integer, got "3"'),
                                   ([{"sae": "mlp", "feature": 3, "coef": True}],
                                    "steering[0].coef: expected a number, got true"),
                                   ([{"vector": "file", "hook": 5, "coef": 1}], "steering[0].hook: expected a string, got 5")]:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "The", "max_tokens": 2, "steering": steering},
                           timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "steering" and fragment in err["message"], err


def test_serve_steering_option_errors_are_one_line(trained_dir: Path, tmp_path: Path) -> None:
    torch.save(torch.ones(7), tmp_path / "odd.pt")
    for args, fragment in [(["--sae", "x"], "expected NAME=PATH"),
                           (["--sae", "x=/nowhere"], "--sae x=/nowhere: --sae /nowhere: no such file"),
                           (["--steering-vector", f"v={tmp_path / 'odd.pt'}"], "7 values; a hook of this model")]:
        code, out = cli("serve", "--weights", str(trained_dir), "--port", "0", *args)
        assert code == 2 and fragment in out and "Traceback" not in out, out

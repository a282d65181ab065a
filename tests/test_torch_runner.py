"""The torch runner (runtime/torch_runner.py) against the native CPU runner, on the CPU: the same logits within
float32 rounding, the same greedy ids through generate, the server, hooks, SAE splicing and steering; its device
picks against projection.reduce_rows; the slots its runs borrow; its errors. Then, where torch sees a CUDA GPU, the
same runner there (skipped elsewhere, with the reason); scripts/check_cuda.py is the whole GPU check.

On the CPU the two runners share model.py's math and, for a decode-sized pass, the native projections (core/ picks a
kernel by the tensor's device, and these tensors are on the CPU): what differs is attention (SDPA over each row's
gathered slot against kernels/attention.cpp, a different order of the same sums), the layer norms (torch's against
block.cpp's) and the embedding sum. Measured: a pass's logits differ by at most 6.7e-7 of the largest logit (the
full-size fixture; 2.2e-7 on the trained one), a decode's logprobs by 1.3e-6. PASS_TOL allows 15x that: a real bug
(a row reading another slot, a position off by one) moves logits by 1e-2 and more.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ROOT, THREADS, cli, gpt2_serve
from safetensors.torch import save_file

from gpt2_engine import GPT2, SAE, Constraint, GPT2EngineError, GenerationError, LoraSettings, Steering
from gpt2_engine.core.lora import LoraAdapter, attach, new_adapter
from gpt2_engine.formats.peft import load_adapter, save_adapter
from gpt2_engine.core.projection import device_project, float32_out, reduce_rows
from gpt2_engine.runtime.plan import Segment
from gpt2_engine.runtime.runner import ModelRunner
from gpt2_engine.runtime.torch_runner import TorchRunner, picks

PASS_TOL = 1e-5  # |torch runner - native| / max |logit| of a pass, and of a decode's logprobs (see the docstring)
PROMPTS = ["Return the number of", "If the file does not exist, raise an error. " * 5, "The default value of the",
           "Open", "Zoë — 東京"]  # one longer than a pass's 32 rows: it is prefilled alone
NEW = 20
NO_CUDA = "needs an NVIDIA GPU (CUDA): torch.cuda.is_available() is False"


@pytest.fixture(scope="module")
def native(trained_dir: Path) -> GPT2:
    return GPT2.from_pretrained(trained_dir)


@pytest.fixture(scope="module")
def on_torch(trained_dir: Path) -> GPT2:
    return GPT2.from_pretrained(trained_dir, runner="torch")


@functools.cache
def held_out() -> list[str]:
    """Docstrings the trained fixture was not trained on (scripts/train_fixture.py parses the standard library)."""
    from train_fixture import unseen

    return unseen()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_picks_on_the_device_are_reduce_rows(on_torch) -> None:
    """The device's argmax / logit / logsumexp are the native reduction's, banned tokens, ties, NaN and -inf rows
    included."""
    V = on_torch.config.vocab_size
    lg = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 4
    lg[1, 7] = lg[1, 9] = 100.0  # a tie: the first
    lg[2, 3] = torch.nan
    lg[3] = -torch.inf
    lg[4, 11] = 1e4  # banned: the runner-up wins
    banned = [-1, -1, -1, -1, 11, 5]
    tokens, best, lse = picks(lg, torch.tensor(banned)).tolist()
    want = reduce_rows(lg, banned)
    assert [int(t) for t in tokens] == want[0] and tokens[1] == 7 and tokens[2] == tokens[3] == -1
    assert torch.allclose(torch.tensor(best), torch.tensor(want[1]), equal_nan=True)
    assert torch.allclose(torch.tensor(lse), torch.tensor(want[2]), equal_nan=True, rtol=1e-6)


def test_a_half_width_projection_off_the_cpu_path() -> None:
    """projection.device_project, which a GPU's projections take, on CPU tensors: without addmm's out_dtype (a CUDA
    kernel) it rounds the activations to the weight's dtype, multiplies, and adds the float32 bias."""
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(5, 64, generator=g), torch.randn(64, 32, generator=g), torch.randn(32, generator=g)
    assert not float32_out(torch.device("cpu"), torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16):
        want = (x.to(dtype) @ w.to(dtype)).float() + bias
        assert torch.equal(device_project(x, w.to(dtype), bias), want)
    assert torch.equal(device_project(x, w, bias), torch.addmm(bias, x, w))


@pytest.mark.parametrize("fixture", [pytest.param("trained_dir", marks=pytest.mark.trained), pytest.param("small_dir", marks=pytest.mark.slow)])
def test_a_pass_and_a_prefill_give_the_native_runners_logits(fixture, request) -> None:
    """Decode rows at several positions, a verify segment of 3 rows, a short prompt riding along and a slot left
    idle: every output row within PASS_TOL of the native runner's, the same argmax."""
    directory = request.getfixturevalue(fixture)
    a, b = GPT2.from_pretrained(directory), GPT2.from_pretrained(directory, runner="torch")
    tok = a.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    ra = a.runner(a.weights, a.config, slots=5, max_len=256)
    rb = b.runner(b.weights, b.config, slots=5, max_len=256)
    for slot, p in enumerate(prompts):
        fa, fb = ra.prefill(slot, p), rb.prefill(slot, p)
        assert relative(fb.logits, fa.logits) <= PASS_TOL and fb.logits.device.type == "cpu"
        assert abs(fa.lse - fb.lse) <= PASS_TOL * float(fa.logits.abs().max())
    segments = [Segment(0, len(prompts[0]), [11]), Segment(1, len(prompts[1]), [13, 262, 3], outputs=3),
                Segment(2, len(prompts[2]), [286], greedy=True), Segment(4, 0, tok.encode("Open a new window"))]
    la, lb = ra.run(segments), rb.run(segments)
    assert lb.shape == la.shape == (6, a.config.vocab_size)
    assert relative(lb, la) <= PASS_TOL
    assert torch.equal(lb.argmax(-1), la.argmax(-1))
    outputs = rb.open(segments)  # the same pass again, as the loop reads it: picks for all, logits for 5 rows
    while not outputs.done:
        outputs.run_block()
    out = outputs.outputs()
    assert out.logits.shape == (5, a.config.vocab_size) and out.picks.tokens == la.argmax(-1).tolist()


def test_greedy_ids_equal_the_native_runners_through_generate(native, on_torch) -> None:
    """Several prompts batched (short ones as rows of shared passes, a long one prefilled alone), <|endoftext|>
    ignored; the same ids, logprobs within PASS_TOL of the largest logit."""
    for kwargs in ({}, {"ignore_eos": True}):
        want = native.complete(PROMPTS, max_new_tokens=NEW, temperature=0, **kwargs)
        got = on_torch.complete(PROMPTS, max_new_tokens=NEW, temperature=0, **kwargs)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            assert max(abs(x - y) for x, y in zip(g.logprobs, w.logprobs)) <= 2e-5  # measured 1.3e-6


def test_sampling_with_a_seed_draws_the_same_tokens(native, on_torch) -> None:
    """The scheduler samples on the host from each runner's logits with the sequence's own generator."""
    kwargs = dict(max_new_tokens=NEW, temperature=0.9, top_k=40, seed=7, num_samples=2)
    want, got = native.complete(PROMPTS[:3], **kwargs), on_torch.complete(PROMPTS[:3], **kwargs)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_a_models_runs_share_one_device_cache_and_give_their_slots_back(trained_dir) -> None:
    model = GPT2.from_pretrained(trained_dir, runner="torch")
    runners = model.runner
    first = model.runner(model.weights, model.config, slots=2)
    cache = runners.current
    assert first.device_cache is cache and cache.free_slots() == []
    assert cache.cache.max_len == model.config.n_positions
    second = model.runner(model.weights, model.config, slots=3)  # none free: a larger cache takes over
    assert second.device_cache is runners.current is not cache and runners.current.slots == 4
    del second
    assert runners.current.free_slots() == [0, 1, 2, 3]
    want = [model.generate(p, max_new_tokens=NEW, temperature=0) for p in (PROMPTS[0], PROMPTS[2])]
    runs = {i: model.stream(p, max_new_tokens=NEW, temperature=0) for i, p in enumerate((PROMPTS[0], PROMPTS[2]))}
    pieces: dict[int, list[str]] = {i: [] for i in runs}
    while runs:  # two generations interleaved on one cache, each on slots of its own
        for i in list(runs):
            if (piece := next(runs[i], None)) is None:
                del runs[i]
            else:
                pieces[i].append(piece)
    assert ["".join(pieces[i]) for i in (0, 1)] == want


def test_run_with_cache_is_the_native_models(native, on_torch) -> None:
    """On the CPU the torch runner's weights are the file's own float32 tensors and the forward is model.py's: the
    same bits at every hook point (on a GPU, check_cuda.py holds them to 1e-4 of the CPU's)."""
    ids = torch.tensor(native.tokenizer.encode(" ".join(held_out()[:5]))[:64]).view(2, 32)
    la, ca = native.run_with_cache(ids)
    lb, cb = on_torch.run_with_cache(ids)
    assert set(ca) == set(cb) and len(ca) == 2 + 17 * native.config.n_layer + 2
    assert torch.equal(la, lb) and all(torch.equal(ca[k], cb[k]) for k in ca)


def write_sae(directory: Path, hook: str, d_in: int, d_sae: int, seed: int, architecture: str = "standard",
              **extra) -> Path:
    """A random SAE in SAELens's layout (cfg.json + sae_weights.safetensors), its features firing on some tokens."""
    g = torch.Generator().manual_seed(seed)
    w = {"W_enc": torch.randn(d_in, d_sae, generator=g) / d_in**0.5, "b_enc": torch.randn(d_sae, generator=g) * 0.1,
         "W_dec": torch.randn(d_sae, d_in, generator=g) / d_sae**0.5, "b_dec": torch.randn(d_in, generator=g) * 0.1}
    if architecture == "jumprelu":
        w["threshold"] = torch.full((d_sae,), 0.05)
    directory.mkdir(parents=True)
    cfg = {"architecture": architecture, "d_in": d_in, "d_sae": d_sae, "hook_name": hook, **extra}
    (directory / "cfg.json").write_text(json.dumps(cfg))
    save_file(w, str(directory / "sae_weights.safetensors"))
    return directory


@pytest.fixture(scope="module")
def saes(tmp_path_factory, native) -> list[Path]:
    root, C = tmp_path_factory.mktemp("saes"), native.config.n_embd
    return [write_sae(root / "resid", "blocks.1.hook_resid_pre", C, 4 * C, 0,
                      model_from_pretrained_kwargs={"center_writing_weights": True}),
            write_sae(root / "z", "blocks.2.attn.hook_z", C, 2 * C, 1, "topk", activation_fn_kwargs={"k": 16}),
            write_sae(root / "ln", "blocks.3.ln2.hook_normalized", C, 2 * C, 2, "jumprelu",
                      model_from_pretrained_kwargs={"fold_ln": True})]


def test_sae_splicing_gives_the_native_models_features_and_logits(native, on_torch, saes) -> None:
    ids = torch.tensor([native.tokenizer.encode(PROMPTS[1])])
    loaded = [SAE.load(p) for p in saes]
    la, ca = native.run_with_cache_with_saes(ids, loaded)
    lb, cb = on_torch.run_with_cache_with_saes(ids, loaded)
    for sae in loaded:
        f = cb[f"{sae.hook_name}.hook_sae_acts_post"]
        assert bool((f != 0).any()) and torch.equal(f, ca[f"{sae.hook_name}.hook_sae_acts_post"])
    assert torch.equal(lb, la) and 0 < float((la - native(ids)).abs().max())  # spliced, so not the plain logits


def test_steering_gives_the_native_runners_greedy_ids(native, on_torch, saes) -> None:
    """Edits before, inside and after the blocks, at the head, on prompt or generated rows, a plain vector and SAE
    latents (added and clamped), steered and unsteered sequences sharing passes: the same ids as natively."""
    C, g = native.config.n_embd, torch.Generator().manual_seed(1)
    word = native.weights.wte[native.tokenizer.encode(" file")[0]].float().clone()
    sae = SAE.load(saes[0])
    edits = [(), (Steering("blocks.1.hook_resid_pre", word, 400.0),),
             (Steering("blocks.2.mlp.hook_post", torch.randn(4 * C, generator=g), 3.0),
              Steering("ln_final.hook_normalized", word, 20.0, "prompt")),
             (Steering("blocks.1.attn.hook_v", torch.randn(C // native.config.n_head, generator=g), 6.0, head=2),),
             (Steering("blocks.3.hook_resid_post", word, 600.0, "generated"),),
             (Steering.clamp(sae, 5, 40.0),), (Steering.from_sae(sae, 9, 30.0, "generated"),)]
    for steering in edits:
        want = native.complete(PROMPTS[:3], max_new_tokens=12, temperature=0, steering=steering)
        got = on_torch.complete(PROMPTS[:3], max_new_tokens=12, temperature=0, steering=steering)
        assert [c.token_ids for c in got] == [c.token_ids for c in want], steering
    plain = native.complete(PROMPTS[:1], max_new_tokens=12, temperature=0)[0].token_ids
    assert plain != native.complete(PROMPTS[:1], max_new_tokens=12, temperature=0, steering=edits[1])[0].token_ids


def test_scoring_on_the_torch_runner_is_the_native_models(native, on_torch) -> None:
    texts = [PROMPTS[1] * 4, PROMPTS[4]]
    want, got = native.score(texts, context=64, stride=32), on_torch.score(texts, context=64, stride=32)
    assert [s.nll for s in got] == [s.nll for s in want]
    cached = on_torch.score(texts, context=64, stride=32, prefix_cache_mb=8)
    assert [abs(c.nll - s.nll) <= 1e-4 for c, s in zip(cached, want)] == [True, True]


def test_a_lora_adapter_and_structured_output_give_the_native_runners_ids(trained_dir, native, on_torch,
                                                                         tmp_path) -> None:
    """An adapter's term on every projection (the static step's, on its single adapter), and grammar masks applied
    by the scheduler to the logits that come back."""
    settings = LoraSettings(r=4)
    fresh = new_adapter(native.config, settings, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    tensors = {k: t if k.endswith("lora_A") else 0.5 * torch.randn(t.shape, generator=g)
               for k, t in fresh.tensors.items()}
    save_adapter(tmp_path / "ad", LoraAdapter(settings, tensors, str(trained_dir)))
    a = GPT2.from_pretrained(trained_dir, lora=tmp_path / "ad")
    b = GPT2.from_pretrained(trained_dir, lora=tmp_path / "ad", runner="torch")
    want = a.complete(PROMPTS[:3], max_new_tokens=12, temperature=0)
    got = b.complete(PROMPTS[:3], max_new_tokens=12, temperature=0)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert want[0].token_ids != native.complete(PROMPTS[:1], max_new_tokens=12, temperature=0)[0].token_ids
    # two adapters stacked on the base (gpt2 serve --lora), each row its own or none: the eager pass, block by block
    ad = load_adapter(tmp_path / "ad", native.config)
    other = LoraAdapter(settings, {k: -t if k.endswith("lora_B") else t for k, t in ad.tensors.items()})
    stacked = [attach(m.weights, [ad, other]) for m in (native, on_torch)]
    ids = [native.tokenizer.encode(p) for p in PROMPTS[:3]]
    segments = [Segment(i, 0, p, adapter=i - 1) for i, p in enumerate(ids)]  # the base, adapter 0, adapter 1
    la = ModelRunner(stacked[0], native.config, 3, 64).run(segments)
    lb = on_torch.runner(stacked[1], native.config, 3, 64).run(segments)
    assert relative(lb, la) <= PASS_TOL and torch.equal(lb.argmax(-1), la.argmax(-1))
    for constraint in (Constraint.choice(["yes", "no", "the default value"]), Constraint.regex(r"[a-z ]{4,24}\.")):
        got = on_torch.complete(PROMPTS[:3], max_new_tokens=16, temperature=0, constraint=constraint)
        want = native.complete(PROMPTS[:3], max_new_tokens=16, temperature=0, constraint=constraint)
        assert [c.text for c in got] == [c.text for c in want]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_width_matrices_agree_with_float32_on_top1(dtype, trained_dir, native) -> None:
    """bfloat16 and float16 projections with a KV cache of that dtype (float32 residual stream, layer norms and
    head): the argmax of the float32 model at >= 99% of a text's positions, and generate runs."""
    model = GPT2.from_pretrained(trained_dir, runner="torch", dtype=dtype)
    # the fixture's whole context: over 256 positions each disagreement is 0.4%, and a fixture trained on an AMX Xeon
    # (bf16 GEMMs on its tiles) gave 98.8% on the first 256 and 99.4% over 512
    ids = torch.tensor([native.tokenizer.encode(" ".join(held_out()[:40]))[: native.config.n_positions]])
    agree = (model(ids).argmax(-1) == native(ids).argmax(-1)).float().mean()
    assert agree >= 0.99, float(agree)
    assert len(model.complete(PROMPTS, max_new_tokens=8, temperature=0, ignore_eos=True)[0].token_ids) == 8


def test_the_server_on_the_torch_runner_answers_as_the_native_engine(trained_dir, native, saes) -> None:
    bodies = [{"prompt": p} for p in PROMPTS] + [
        {"prompt": PROMPTS[0], "steering": [{"sae": "resid", "feature": 5, "clamp": 40.0}]}]
    expected = [native.generate(p, max_new_tokens=NEW, temperature=0) for p in PROMPTS] + [
        native.generate(PROMPTS[0], max_new_tokens=NEW, temperature=0,
                        steering=[Steering.clamp(SAE.load(saes[0]), 5, 40.0)])]
    with gpt2_serve("--weights", str(trained_dir), "--runner", "torch", "--parallel", "4", "--threads", str(THREADS),
                    "--sae", f"resid={saes[0]}") as (url, _):
        def run(body: dict) -> str:
            r = httpx.post(f"{url}/v1/completions", json={"max_tokens": NEW, "temperature": 0, **body}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert [run(b) for b in bodies] == expected
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:  # more requests than slots: they queue
            assert list(pool.map(run, bodies * 2)) == expected * 2


def test_errors_name_what_is_wrong(trained_dir, on_torch) -> None:
    cases = [({"runner": "torch", "quantize": "int8"}, "quantize='int8' runs on the native CPU runner"),
             ({"dtype": "float16"}, "dtype float16 runs on the torch runner"),
             ({"device": "tpu"}, "device: expected 'cpu' or 'cuda'"),
             ({"runner": "fast"}, "runner: expected 'native' or 'torch'")]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, "sees no CUDA GPU"))
    for kwargs, message in cases:
        with pytest.raises(GPT2EngineError, match=re.escape(message)):
            GPT2.from_pretrained(trained_dir, **kwargs)
    with pytest.raises(GenerationError, match="only 'ngram'"):
        on_torch.generate(PROMPTS[0], max_new_tokens=4, speculate="int4")
    with pytest.raises(GPT2EngineError, match="finetune trains with the engine's CPU backward"):
        on_torch.finetune(["some text"], steps=1)
    ngram = on_torch.generation([PROMPTS[1]], max_new_tokens=12, temperature=0, speculate="ngram", draft_tokens=3)
    assert ngram.run()[0].token_ids == on_torch.generate_ids(on_torch.tokenizer.encode(PROMPTS[1]), max_new_tokens=12,
                                                             temperature=0)


def test_the_command_line_takes_device_and_runner(trained_dir, capsys) -> None:
    code, _ = cli("generate", PROMPTS[0], "--weights", str(trained_dir), "--runner", "torch", "-n", "8",
                  "--temperature", "0", "--json")
    assert code == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == GPT2.from_pretrained(trained_dir).complete([PROMPTS[0]], max_new_tokens=8,
                                                                          temperature=0)[0].token_ids
    if not torch.cuda.is_available():
        code, err = cli("generate", PROMPTS[0], "--weights", str(trained_dir), "--device", "cuda")
        assert code == 2 and "sees no CUDA GPU" in err and "Traceback" not in err


@pytest.mark.slow
def test_check_cuda_runs_its_cpu_side_checks() -> None:
    """scripts/check_cuda.py --cpu --quick: the torch runner against the native one and transformers, one table."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_cuda.py"), "--cpu", "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| check" in done.stdout and "FAIL" not in done.stdout and "all checks passed" in done.stdout


# --- on a GPU: skipped elsewhere; scripts/check_cuda.py runs the whole of issue #59's list there --------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_greedy_ids_equal_the_cpu_and_graphs_equal_eager_steps(trained_dir, native) -> None:
    gpu = GPT2.from_pretrained(trained_dir, device="cuda")
    want = native.complete(PROMPTS, max_new_tokens=NEW, temperature=0)
    got = gpu.complete(PROMPTS, max_new_tokens=NEW, temperature=0)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    segments = [Segment(0, 0, gpu.tokenizer.encode(PROMPTS[0])), Segment(1, 0, gpu.tokenizer.encode(PROMPTS[2]))]
    graphs = TorchRunner(gpu.weights, gpu.config, 2, 64, graphs=True).run(segments)
    eager = TorchRunner(gpu.weights, gpu.config, 2, 64, graphs=False).run(segments)
    assert torch.equal(graphs, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_float32_logits_equal_transformers_on_the_gpu(trained_dir, native) -> None:
    from conftest import reference

    gpu = GPT2.from_pretrained(trained_dir, device="cuda")
    hf = reference(trained_dir).cuda()
    ids = torch.tensor([native.tokenizer.encode(PROMPTS[1])], device="cuda")
    with torch.no_grad():
        want = hf(ids).logits
    got = gpu(ids)
    assert relative(got, want) <= 1e-4 and torch.equal(got.argmax(-1), want.argmax(-1))

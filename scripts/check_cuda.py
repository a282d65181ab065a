#!/usr/bin/env python3
"""Issue #59's checks of the engine on an NVIDIA GPU (the torch runner, runtime/torch_runner.py), in one run that
prints one table: PASS or FAIL a row, exit 1 on any FAIL.

    python scripts/check_cuda.py [--quick] [--no-bench] [--repeats 3] [--out DIR]
    python scripts/check_cuda.py --cpu [--quick]     # the checks that need no GPU (also what runs without one)

On the GPU machine (torch with CUDA, transformers 5, Python 3.12, no network), from the repository root, with the
wheels and the packed trained fixture that scripts/cuda_wheels.sh writes into the git-ignored .whl/ and
.cuda-fixtures/ carried along (27 MB; the full-size fixture is made there, in seconds):

    run(command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH && python3 scripts/check_cuda.py --out $OUT",
        carry=[".whl", ".cuda-fixtures"], timeout_s=540)

(sized to finish in about 5 minutes there, fixtures included; --quick leaves out the server and the full-size
fixture's slower rows, --no-bench the timing rows).

The GPU rows, each on the full-size random fixture (scripts/make_fixture.py) and the trained one
(scripts/train_fixture.py) where the issue asks for both:
- float32 logits within 1e-4 x max |logit| of transformers' float32 on the same GPU (TF32 off on both), argmax equal;
- greedy ids equal to transformers' generate on the GPU, and to the native CPU engine's;
- bfloat16 (and float16) top-1 agreement with float32 >= 99% on the trained fixture;
- run_with_cache at every hook point within 1e-4 (of each activation's largest value) of the CPU's; SAE features
  (three random SAEs: relu on the residual stream under center_writing_weights, topk on hook_z, jumprelu on ln2
  under fold_ln) within 1e-4 of the CPU's; steered greedy ids equal to the CPU's; scores within 1e-5;
- the captured CUDA graphs give the eager steps' logits, bit for bit;
- `gpt2 serve --device cuda` answers greedy completions as the CPU engine does;
- timing (`make bench`'s method: alternating rounds after a warm-up each, medians): decode at batch 1 with 256 new
  tokens >= 2x transformers' generate, float32 and bfloat16 against transformers in the same dtype; batch 64's
  aggregate >= 1.5x; prefill of 1,024 tokens >= 1x.
The CPU rows (--cpu): the torch runner on the CPU against the native runner (logits of a pass, greedy ids, hooks,
SAEs, steering) and against transformers on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import lzma
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PROMPTS = ["Return the number of", "If the file does not exist, raise an error. " * 5, "The default value of the",
           "Zoë — 東京", "The quick brown fox jumps over the lazy dog while the farmer watches from the"]
PACKED_TRAINED = ROOT / ".cuda-fixtures" / "trained.tar.xz"  # scripts/cuda_wheels.sh packs it
UNPACKED = ROOT / ".cache" / "cuda-fixtures" / "trained"


@dataclass
class Row:
    check: str
    where: str
    measured: str
    required: str
    ok: bool


class Table:
    """The rows so far, each printed as it is made (a run cut short still says what it found)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def add(self, check: str, where: str, measured: str, required: str, ok: bool) -> bool:
        self.rows.append(Row(check, where, measured, required, bool(ok)))
        print(f"  {'PASS' if ok else 'FAIL'}  {check} [{where}]: {measured} (required: {required})", file=sys.stderr,
              flush=True)
        return bool(ok)

    def failed(self, check: str, where: str, error: BaseException) -> None:
        """A check that raised: a FAIL row naming the exception."""
        self.add(check, where, f"{type(error).__name__}: {' '.join(str(error).split())[:120]}", "no error", False)

    def render(self, title: str) -> str:
        w = [max(len(h), *(len(getattr(r, f)) for r in self.rows)) for h, f in
             (("check", "check"), ("fixture", "where"), ("measured", "measured"), ("required", "required"))]
        line = lambda cells: "| " + " | ".join(c.ljust(n) for c, n in zip(cells, w + [6])) + " |"  # noqa: E731
        out = [title, "", line(["check", "fixture", "measured", "required", "result"]),
               "|" + "|".join("-" * (n + 2) for n in w + [6]) + "|"]
        out += [line([r.check, r.where, r.measured, r.required, "PASS" if r.ok else "FAIL"]) for r in self.rows]
        bad = sum(not r.ok for r in self.rows)
        out += ["", f"{len(self.rows) - bad} passed, {bad} failed" if bad else f"all checks passed ({len(self.rows)})"]
        return "\n".join(out)


def guarded(table: Table, check: str, where: str, fn: Callable[[], None]) -> None:
    """Run one check; an exception is its FAIL row, and the run goes on."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - every check reports, none ends the run
        table.failed(check, where, e)


def tf32_off() -> None:
    """IEEE float32 matmuls and convolutions for both sides (torch's default; set, not assumed)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


# --- fixtures ---------------------------------------------------------------------------------------------------------


def trained_fixture() -> Path:
    """The trained checkpoint: the packed copy carried to the GPU machine, else the fixture cache's (built here)."""
    if PACKED_TRAINED.is_file():
        if not (UNPACKED / "model.safetensors").is_file():
            tmp = UNPACKED.with_name("trained.tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            with lzma.open(PACKED_TRAINED) as xz, tarfile.open(fileobj=xz) as tar:
                tar.extractall(tmp, filter="data")
            tmp.replace(UNPACKED)
        return UNPACKED
    import fixtures

    return fixtures.ensure("trained")


def small_fixture() -> Path:
    import fixtures

    return fixtures.ensure("small")


def reference(directory: Path, device: str, dtype: torch.dtype = torch.float32):
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    return GPT2LMHeadModel.from_pretrained(directory, dtype=dtype).to(device).eval()


@functools.cache
def held_out() -> list[str]:
    """Docstrings the trained fixture never saw (the standard library's, parsed once: seconds)."""
    from train_fixture import unseen

    return unseen()[:200]


def text_ids(tokenizer, n: int) -> torch.Tensor:
    """[1, n] ids of held-out text."""
    ids: list[int] = []
    for doc in held_out():
        ids += tokenizer.encode(doc) + [tokenizer.eot_id]
        if len(ids) >= n:
            return torch.tensor([ids[:n]])
    raise SystemExit("check_cuda: not enough held-out text")


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, over the entries that are values (masked attention scores, float32's minimum
    on both sides, are left out: they would make any difference look nil)."""
    got, want = got.float().cpu(), want.float().cpu()
    keep = want > torch.finfo(torch.float32).min
    return float((got - want)[keep].abs().max() / want[keep].abs().max().clamp_min(1e-30))


def random_saes(config) -> list:
    """Three SAEs of random weights: their math is interp/sae.py's, held to SAELens by tests/test_sae.py; here
    the GPU is held to the CPU."""
    from gpt2_engine import SAE
    from gpt2_engine.formats.saes import SAEConfig

    C = config.n_embd
    specs = [SAEConfig("standard", C, 4 * C, "blocks.1.hook_resid_pre",
                       model_from_pretrained_kwargs={"center_writing_weights": True}),
             SAEConfig("topk", C, 2 * C, "blocks.2.attn.hook_z", k=16, reshape_activations="hook_z"),
             SAEConfig("jumprelu", C, 2 * C, f"blocks.{config.n_layer - 1}.ln2.hook_normalized",
                       model_from_pretrained_kwargs={"fold_ln": True})]
    out = []
    for seed, c in enumerate(specs):
        g = torch.Generator().manual_seed(seed)
        w = {"W_enc": torch.randn(C, c.d_sae, generator=g) / C**0.5, "b_enc": torch.randn(c.d_sae, generator=g) * 0.1,
             "W_dec": torch.randn(c.d_sae, C, generator=g) / c.d_sae**0.5, "b_dec": torch.randn(C, generator=g) * 0.1}
        if c.architecture == "jumprelu":
            w["threshold"] = torch.full((c.d_sae,), 0.05)
        out.append(SAE(c, w))
    return out


def steerings(model, saes: list) -> list[tuple]:
    from gpt2_engine import Steering

    C, g = model.config.n_embd, torch.Generator().manual_seed(1)
    word = model.weights.wte[model.tokenizer.encode(" file")[0]].float().cpu()
    scale = float(model.weights.wpe.float().norm(dim=-1).mean())  # the residual stream's size, the coefficients'
    return [(Steering("blocks.1.hook_resid_pre", word / word.norm() * scale, 1.0),),
            (Steering("blocks.2.mlp.hook_post", torch.randn(4 * C, generator=g), 3.0),
             Steering("ln_final.hook_normalized", word, 20.0, "prompt")),
            (Steering.clamp(saes[0], 5, 40.0),)]


# --- the checks -------------------------------------------------------------------------------------------------------


def check_logits(table: Table, where: str, engine, hf, tokens: int) -> None:
    """float32 logits against transformers' on the same device, one long text and the prompts."""
    ids = [text_ids(engine.tokenizer, min(tokens, engine.config.n_positions))[0].tolist()]
    ids += [engine.tokenizer.encode(p) for p in PROMPTS]
    worst, same = 0.0, True
    for seq in ids:
        x = torch.tensor([seq], device=engine.device)
        with torch.no_grad():
            want = hf(x).logits
        got = engine(x)
        worst = max(worst, relative(got, want))
        same &= bool(torch.equal(got.argmax(-1).cpu(), want.argmax(-1).cpu()))
    table.add("float32 logits vs transformers", where, f"max|diff| {worst:.2e} x max|logit|, argmax "
              f"{'equal' if same else 'DIFFERS'} ({sum(map(len, ids))} positions)", "<= 1e-4, argmax equal",
              worst <= 1e-4 and same)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    x = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=50256)
    return out[0, len(prompt):].tolist()


def check_greedy(table: Table, where: str, engine, hf, cpu, n: int) -> None:
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    got = [c.token_ids for c in engine.complete(prompts, max_new_tokens=n, temperature=0, ignore_eos=True)]
    if hf is not None:
        want = [hf_greedy(hf, p, n) for p in prompts]
        same = sum(g == w for g, w in zip(got, want))
        table.add("greedy ids vs transformers' generate", where, f"{same}/{len(prompts)} prompts x {n} tokens equal",
                  "all equal", same == len(prompts))
    if cpu is not None:
        want = [c.token_ids for c in cpu.complete(prompts, max_new_tokens=n, temperature=0, ignore_eos=True)]
        same = sum(g == w for g, w in zip(got, want))
        table.add("greedy ids vs the native CPU engine", where, f"{same}/{len(prompts)} prompts x {n} tokens equal",
                  "all equal", same == len(prompts))


def check_top1(table: Table, where: str, directory: Path, device: str, fp32) -> None:
    from gpt2_engine import GPT2

    ids = text_ids(fp32.tokenizer, 2048)
    windows = ids.view(-1, 512)[:, : fp32.config.n_positions]
    want = torch.cat([fp32(w[None]).argmax(-1).cpu() for w in windows])
    for dtype in ("bfloat16", "float16"):
        model = GPT2.from_pretrained(directory, device=device, runner="torch", dtype=dtype)
        got = torch.cat([model(w[None]).argmax(-1).cpu() for w in windows])
        agree = float((got == want).float().mean())
        table.add(f"{dtype} top-1 agreement with float32", where, f"{agree:.2%} of {want.numel()} positions",
                  ">= 99%", agree >= 0.99)


def check_hooks_saes_steering(table: Table, where: str, engine, cpu) -> None:
    """The device's run_with_cache, SAE features, steered greedy ids and scores against the CPU engine's."""
    ids = text_ids(engine.tokenizer, 96).view(2, 48)
    _, got = engine.run_with_cache(ids)
    _, want = cpu.run_with_cache(ids)
    worst = max((relative(got[k], want[k]), k) for k in want)
    table.add("run_with_cache vs the CPU's", where, f"max {worst[0]:.2e} of an activation's max ({worst[1]}; "
              f"{len(want)} hook points)", "<= 1e-4", worst[0] <= 1e-4 and set(got) == set(want))
    saes = random_saes(engine.config)
    _, got = engine.run_with_cache_with_saes(ids, saes)
    _, want = cpu.run_with_cache_with_saes(ids, saes)
    names = [f"{s.hook_name}.hook_sae_acts_post" for s in saes]
    worst = max(relative(got[n], want[n]) for n in names)
    firing = min(float((want[n] != 0).float().mean()) for n in names)
    table.add("SAE features vs the CPU's", where, f"max {worst:.2e} of the largest feature (3 SAEs; >= "
              f"{firing:.0%} nonzero)", "<= 1e-4", worst <= 1e-4 and firing > 0)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    same = total = 0
    for steering in steerings(cpu, saes):
        a = engine.complete(prompts, max_new_tokens=16, temperature=0, steering=steering)
        b = cpu.complete(prompts, max_new_tokens=16, temperature=0, steering=steering)
        same += sum(x.token_ids == y.token_ids for x, y in zip(a, b))
        total += len(prompts)
    table.add("steered greedy ids vs the CPU's", where, f"{same}/{total} (3 steerings x 3 prompts, 16 tokens)",
              "all equal", same == total)
    texts = [" ".join(PROMPTS) * 6, PROMPTS[3]]
    a, b = engine.score(texts, context=128, stride=64), cpu.score(texts, context=128, stride=64)
    worst = max(abs(x.nll - y.nll) / max(abs(y.nll), 1e-9) for x, y in zip(a, b))
    table.add("score (nll) vs the CPU's", where, f"relative {worst:.1e}", "<= 1e-5", worst <= 1e-5)


def check_graphs(table: Table, where: str, engine) -> None:
    """The same static steps captured as CUDA graphs and run eagerly."""
    from gpt2_engine.runtime.plan import Segment
    from gpt2_engine.runtime.torch_runner import TorchRunner

    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    runs = []
    for graphs in (True, False):
        r = TorchRunner(engine.weights, engine.config, 3, 256, graphs=graphs)
        for slot, p in enumerate(prompts[:2]):
            r.prefill(slot, p)
        runs.append(r.run([Segment(0, len(prompts[0]), [11]), Segment(1, len(prompts[1]), [13, 262], outputs=2),
                           Segment(2, 0, prompts[2])]))
    # the graph replays the kernels the eager step launched, on the same inputs
    same = bool(torch.equal(runs[0].argmax(-1), runs[1].argmax(-1)))
    table.add("CUDA graph steps vs eager steps", where, "bit-equal logits" if torch.equal(*runs) else
              f"{relative(runs[0], runs[1]):.1e} x max|logit|, argmax {'equal' if same else 'DIFFERS'}", "bit-equal",
              torch.equal(*runs))


def check_inspect(table: Table, where: str, engine, cpu) -> None:
    """gpt2 inspect's report (run_with_cache, the logit lens, attributions with gradients, head probes) on the
    device: its target and log-probability against the CPU's."""
    from gpt2_engine.inspect.report import build_report

    got, want = build_report(engine, PROMPTS[4]), build_report(cpu, PROMPTS[4])
    diff = abs(got["target"]["logprob"] - want["target"]["logprob"])
    ig = max(abs(a - b) for a, b in zip(got["attribution"]["integrated_gradients"],
                                         want["attribution"]["integrated_gradients"]))
    ok = got["target"]["id"] == want["target"]["id"] and diff <= 1e-4 and ig <= 1e-3
    table.add("gpt2 inspect's report vs the CPU's", where, f"same target, log p within {diff:.1e}, integrated "
              f"gradients within {ig:.1e}" if got["target"]["id"] == want["target"]["id"] else "another target",
              "same target, 1e-4, 1e-3", ok)


def check_server(table: Table, directory: Path, cpu, device: str) -> None:
    """`gpt2 serve --device cuda` (127.0.0.1, a free port): greedy completions as the CPU engine makes them."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile("w+")  # not a pipe: a server that writes much must never block on it
    proc = subprocess.Popen([sys.executable, "-m", "gpt2_engine", "serve", "--weights", str(directory), "--device",
                             device, "--port", str(port), "--parallel", "4"], stdout=subprocess.DEVNULL, stderr=log,
                            text=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)  # polling the server's start, not timing anything
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"gpt2 serve exited {proc.returncode}: {log.read()[-300:]}")
        got = [httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": p, "max_tokens": 24,
                                                                     "temperature": 0}).json()["choices"][0]["text"]
               for p in PROMPTS]
        want = [cpu.generate(p, max_new_tokens=24, temperature=0) for p in PROMPTS]
        same = sum(g == w for g, w in zip(got, want))
        table.add("gpt2 serve --device cuda vs the CPU engine", "trained", f"{same}/{len(PROMPTS)} completions equal",
                  "all equal", same == len(PROMPTS))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# --- timing -----------------------------------------------------------------------------------------------------------


def bench(table: Table, directory: Path, device: str, repeats: int) -> list[dict]:
    """`make bench ARGS="--device cuda"`'s rows (bench.device_rows), each judged against issue #59's target."""
    from bench import device_rows

    rows = device_rows(directory, device, repeats)
    for r in rows:
        need = 1.0 if r["row"].startswith("prefill") else 2.0 if r["batch"] == 1 else 1.5
        what = r["row"].replace(" (tok/s)", "")
        table.add(f"{what} ({r['dtype']}) vs transformers", "full-size", f"{r['engine']:,.0f} vs "
                  f"{r['transformers']:,.0f} tok/s: {r['ratio']:.2f}x", f">= {need:g}x", r["ratio"] >= need)
    return rows


# --- the runs ---------------------------------------------------------------------------------------------------------


def gpu_checks(table: Table, args: argparse.Namespace) -> list[dict]:
    from gpt2_engine.core.kernels import decode_kernels

    # the CPU reference's native kernels build (where there is a compiler) while the GPU works
    build = threading.Thread(target=decode_kernels, daemon=True)
    build.start()
    gpu_fixture(table, "trained", trained_fixture(), args, build)
    small = None if args.quick else small_fixture()
    if small is not None:
        gpu_fixture(table, "full-size", small, args, build)
    if not args.bench:
        return []
    torch.cuda.empty_cache()
    timing: list[dict] = []
    guarded(table, "timing", "full-size", lambda: timing.extend(bench(table, small or small_fixture(), args.device,
                                                                      args.repeats)))
    return timing


def gpu_fixture(table: Table, where: str, directory: Path, args: argparse.Namespace, build: threading.Thread) -> None:
    """The GPU rows of one fixture: the engine there against transformers there and the CPU engine."""
    from gpt2_engine import GPT2

    device, trained = args.device, where == "trained"
    gpu, hf = GPT2.from_pretrained(directory, device=device), reference(directory, device)
    guarded(table, "float32 logits vs transformers", where,
            lambda: check_logits(table, where, gpu, hf, gpu.config.n_positions))
    if trained:
        guarded(table, "bfloat16 top-1 agreement with float32", where,
                lambda: check_top1(table, where, directory, device, gpu))
        guarded(table, "CUDA graph steps vs eager steps", where, lambda: check_graphs(table, where, gpu))
    build.join()
    cpu = GPT2.from_pretrained(directory)
    guarded(table, "greedy ids", where, lambda: check_greedy(table, where, gpu, hf, cpu, 48 if trained else 32))
    guarded(table, "hooks, SAEs, steering", where, lambda: check_hooks_saes_steering(table, where, gpu, cpu))
    if trained and not args.quick:
        guarded(table, "gpt2 serve --device cuda vs the CPU engine", where,
                lambda: check_server(table, directory, cpu, device))
        guarded(table, "gpt2 inspect's report vs the CPU's", where, lambda: check_inspect(table, where, gpu, cpu))


def cpu_checks(table: Table, args: argparse.Namespace) -> None:
    """The torch runner on the CPU against the native runner and transformers: what CI can run."""
    cpu_fixture(table, "trained", trained_fixture(), args.quick)
    if not args.quick:
        cpu_fixture(table, "full-size", small_fixture(), args.quick)


def cpu_fixture(table: Table, where: str, directory: Path, quick: bool) -> None:
    from gpt2_engine import GPT2
    from gpt2_engine.runtime.plan import Segment

    native, torch_cpu = GPT2.from_pretrained(directory), GPT2.from_pretrained(directory, runner="torch")
    hf = reference(directory, "cpu")

    def pass_logits() -> None:
        tok = native.tokenizer
        prompts = [tok.encode(p) for p in PROMPTS[:3]]
        runners = [m.runner(m.weights, m.config, slots=4, max_len=256) for m in (native, torch_cpu)]
        for r in runners:
            for slot, p in enumerate(prompts):
                r.prefill(slot, p)
        segments = [Segment(0, len(prompts[0]), [11]), Segment(1, len(prompts[1]), [13, 262, 3], outputs=3),
                    Segment(2, len(prompts[2]), [286]), Segment(3, 0, tok.encode("Open a new window"))]
        a, b = (r.run(segments) for r in runners)
        worst, same = relative(b, a), bool(torch.equal(a.argmax(-1), b.argmax(-1)))
        table.add("torch runner vs native: a pass's logits", where, f"{worst:.1e} x max|logit|, argmax "
                  f"{'equal' if same else 'DIFFERS'}", "<= 1e-5, argmax equal", worst <= 1e-5 and same)

    here = where + ", torch on CPU"
    guarded(table, "torch runner vs native: a pass's logits", where, pass_logits)
    guarded(table, "greedy ids", here, lambda: check_greedy(table, here, torch_cpu, hf, native, 16 if quick else 48))
    guarded(table, "float32 logits vs transformers", here,
            lambda: check_logits(table, here, torch_cpu, hf, 128 if quick else 1024))
    if where == "trained":
        guarded(table, "hooks, SAEs, steering", here, lambda: check_hooks_saes_steering(table, here, torch_cpu, native))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the CPU-side checks only (what runs without a GPU)")
    p.add_argument("--device", default="cuda", help="the GPU (default cuda)")
    p.add_argument("--quick", action="store_true", help="the trained fixture only, no server; fewer tokens")
    p.add_argument("--no-bench", dest="bench", action="store_false", help="leave out the timing rows")
    p.add_argument("--repeats", type=int, default=3, help="alternating timing rounds; medians reported (default 3)")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, help="a directory for check_cuda.md (the table) and check_cuda.json")
    args = p.parse_args()
    t0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    table = Table()
    gpu = not args.cpu and torch.cuda.is_available()
    if gpu:
        tf32_off()
        name = torch.cuda.get_device_name(torch.device(args.device))
        where = f"{name}, torch {torch.__version__} (CUDA {torch.version.cuda})"
        timing = gpu_checks(table, args)
    else:
        if not args.cpu:
            print("check_cuda: torch sees no CUDA GPU; running the CPU-side checks (--cpu)", file=sys.stderr)
        from gpt2_engine.core.kernels import cpu

        where = f"CPU only: {cpu().summary()}, torch {torch.__version__}"
        timing = []
        cpu_checks(table, args)
    import transformers

    title = (f"gpt2-engine check_cuda ({'GPU' if gpu else 'CPU side'}): {where}, transformers "
             f"{transformers.__version__}, TF32 off; {time.perf_counter() - t0:.0f} s")
    text = table.render(title)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "check_cuda.md").write_text(text + "\n")
        (args.out / "check_cuda.json").write_text(json.dumps({"title": title, "rows": [asdict(r) for r in table.rows],
                                                              "timing": timing}, indent=2) + "\n")
    return 0 if table.rows and all(r.ok for r in table.rows) else 1


if __name__ == "__main__":
    sys.exit(main())

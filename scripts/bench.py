#!/usr/bin/env python3
"""Benchmark gpt2-engine against transformers on the same weights, in one run (`make bench`).

    python scripts/bench.py [--weights DIR] [--threads 2] [--repeats 3] [--new-tokens 256] [--variants fp32,bf16,int8,int4]

    python scripts/bench.py --device cuda [--repeats 3]   # on a GPU: the torch runner against transformers there

Rows: prefill tokens/s at 128 / 512 / 1024 tokens (ids in, first token out); decode tokens/s at batch 1 and batch 8
(16-token prompt, greedy, N new tokens: (N - 1) / (t(N) - t(1))); scoring tokens/s of `gpt2 score`'s core against
transformers' sliding-window loop on the same windows (~50,000 tokens of docstrings); time from process start to the
first generated token; peak RSS of a generate run. Every row alternates engine and reference, repeats, and reports the median. Without
--weights it runs on the full-size official-layout fixture (speed does not depend on the weight values). Prints a
table with the ratio engine / transformers for each row and writes JSON (default bench-results/bench.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPT_16 = "The quick brown fox jumps over the lazy dog while the farmer watches from the"  # 16 GPT-2 tokens


def load_engine(weights: Path, variant: str):
    from gpt2_engine import GPT2

    if variant in ("int8", "int4"):
        return GPT2.from_pretrained(weights, quantize=variant)
    return GPT2.from_pretrained(weights, dtype={"fp32": "float32", "bf16": "bfloat16"}[variant])


def load_reference(weights: Path):
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    return GPT2LMHeadModel.from_pretrained(weights, dtype=torch.float32).eval()


def engine_generate(model, ids: torch.Tensor, new_tokens: int, steering: tuple = ()) -> float:
    """Seconds to generate `new_tokens` greedily from ids [B, T] (prefill included)."""
    run = model.generation(ids.tolist(), max_new_tokens=new_tokens, temperature=0, ignore_eos=True, steering=steering)
    t0 = time.perf_counter()
    run.run()
    return time.perf_counter() - t0


# structured output's row: a schema whose strings may run long, so that decoding lasts as long as the free run's
STRUCTURED_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "lines": {"type": "array", "items": {
    "type": "string"}}}, "required": ["title", "lines"]}


def constrained_rate(model, ids: torch.Tensor, new_tokens: int) -> float:
    """Decode tokens per second of greedy generation constrained to STRUCTURED_SCHEMA (prefill subtracted): the
    runs end where the grammar does, so the rate counts the tokens each made."""
    from gpt2_engine import Constraint

    def run(n: int) -> tuple[float, int]:
        gen = model.generation(ids.tolist(), max_new_tokens=n, temperature=0,
                               constraint=Constraint.json_schema(STRUCTURED_SCHEMA))
        t0 = time.perf_counter()
        done = gen.run()
        return time.perf_counter() - t0, sum(len(c.token_ids) for c in done)

    (whole, tokens), (first, firsts) = run(new_tokens), run(1)
    return (tokens - firsts) / (whole - first)


def structured_rows(model, prompt: list[int], new_tokens: int, repeats: int) -> list[dict]:
    """Free greedy decode against decode constrained to a JSON schema, batch 1 and 8, alternating, medians."""
    rows = []
    for batch in (1, 8):
        ids = torch.tensor([prompt] * batch)
        free, constrained = [], []
        constrained_rate(model, ids, 8)  # warm: the grammar compiler and its cache
        for _ in range(repeats):
            free.append(batch * (new_tokens - 1) / (engine_generate(model, ids, new_tokens) - engine_generate(model, ids, 1)))
            constrained.append(constrained_rate(model, ids, new_tokens))
        f, c = statistics.median(free), statistics.median(constrained)
        rows.append({"batch": batch, "free_tok_s": f, "json_schema_tok_s": c, "ratio": c / f})
        print(f"  structured output, batch {batch}: free {f:.1f} tok/s, JSON schema {c:.1f} tok/s ({c / f:.2f}x)",
              file=sys.stderr, flush=True)
    return rows


def steering_rows(model, prompt: list[int], new_tokens: int, repeats: int) -> list[dict]:
    """Batch-1 greedy decode with one steering vector against plain decode, alternating, medians: between blocks
    (the native block path runs on; the vector is added between two native calls) and inside a block (that block
    runs in torch for the steered row)."""
    from gpt2_engine import Steering

    C, mid = model.config.n_embd, model.config.n_layer // 2
    vector = torch.randn(C, generator=torch.Generator().manual_seed(0))
    edits = {"plain": (), f"blocks.{mid}.hook_resid_pre": (Steering(f"blocks.{mid}.hook_resid_pre", vector, 4.0),),
             f"blocks.{mid}.hook_mlp_out": (Steering(f"blocks.{mid}.hook_mlp_out", vector, 4.0),)}
    ids = torch.tensor([prompt])
    rates: dict[str, list[float]] = {name: [] for name in edits}
    for steering in edits.values():  # warm
        engine_generate(model, ids, 8, steering)
    for _ in range(repeats):
        for name, steering in edits.items():
            t = engine_generate(model, ids, new_tokens, steering) - engine_generate(model, ids, 1, steering)
            rates[name].append((new_tokens - 1) / t)
    plain = statistics.median(rates["plain"])
    rows = []
    for name, values in rates.items():
        r = statistics.median(values)
        rows.append({"steering": name, "tok_s": r, "ratio": r / plain})
        print(f"  steering, batch 1, {name}: {r:.1f} tok/s ({r / plain:.3f}x plain)", file=sys.stderr, flush=True)
    return rows


def reference_generate(hf, ids: torch.Tensor, new_tokens: int) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=50256)
    return time.perf_counter() - t0


def bench_text(tokens: int, tokenizer) -> list[int]:
    """About `tokens` token ids of real text: the standard library's docstrings, in file order."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_fixture import corpus

    ids: list[int] = []
    for doc in corpus():
        ids += tokenizer.encode(doc)
        if len(ids) >= tokens:
            break
    return ids[:tokens]


def engine_score(model, ids: list[int], context: int, stride: int) -> float:
    """Seconds for the engine's scorer (`gpt2 score`'s core) over one document of `ids`."""
    from gpt2_engine.runtime.scoring import ScoreSettings, score_documents

    t0 = time.perf_counter()
    list(score_documents(model.weights, model.config, model.tokenizer.eot_id, [("bench", ids, 0)],
                         ScoreSettings(context, stride)))
    return time.perf_counter() - t0


def reference_score(hf, ids: list[int], context: int, stride: int) -> float:
    """Seconds for transformers' sliding-window perplexity loop (its guide's, labels -100 outside the scored part),
    over the same windows as the engine."""
    from gpt2_engine.runtime.scoring import windows

    seq = torch.tensor([50256, *ids])
    t0 = time.perf_counter()
    with torch.no_grad():
        for w in windows(len(seq), context, stride):
            x = seq[None, w.begin : w.end]
            labels = x.clone()
            labels[:, : w.first - w.begin] = -100
            hf(x, labels=labels).loss.item()
    return time.perf_counter() - t0


def measure_row(engine_runs: dict, reference_run, repeats: int, warmup: bool = True) -> tuple[dict[str, float], float]:
    """Median seconds of each engine variant's run and of the reference's, alternating (after one warm-up each)."""
    for run in (reference_run, *engine_runs.values()) if warmup else ():
        run()
    times: dict[str, list[float]] = {v: [] for v in engine_runs}
    ref: list[float] = []
    for _ in range(repeats):
        ref.append(reference_run())
        for v, run in engine_runs.items():
            times[v].append(run())
    return {v: statistics.median(t) for v, t in times.items()}, statistics.median(ref)


def child(kind: str, weights: Path, variant: str, new_tokens: int) -> None:
    """Run in a fresh process: load, generate one token (print FIRST), then a whole run; print peak RSS."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    if kind == "engine":
        model = load_engine(weights, variant)
        ids = model.tokenizer.encode(PROMPT_16)
        model.generate_ids(ids, max_new_tokens=1, temperature=0)
        print("FIRST", flush=True)
        model.generate_ids(ids, max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    else:
        from transformers import GPT2TokenizerFast

        tok = GPT2TokenizerFast.from_pretrained(weights)
        hf = load_reference(weights)
        ids = torch.tensor([tok(PROMPT_16)["input_ids"]])
        reference_generate(hf, ids, 1)
        print("FIRST", flush=True)
        reference_generate(hf, ids, new_tokens)
    print("RSS_KB", peak_rss_kb(), flush=True)


def peak_rss_kb() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def startup_and_rss(kind: str, weights: Path, variant: str, threads: int) -> tuple[float, float]:
    """(seconds from process start to first token, peak RSS in MiB) of one child process."""
    env = dict(os.environ, BENCH_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, "--weights", str(weights), "--variants", variant],
                            stdout=subprocess.PIPE, text=True, env=env)
    first = rss = None
    for line in proc.stdout:
        if line.startswith("FIRST") and first is None:
            first = time.perf_counter() - t0
        elif line.startswith("RSS_KB"):
            rss = int(line.split()[1]) / 1024
    if proc.wait() != 0 or first is None or rss is None:
        raise SystemExit(f"bench: the {kind} child process failed")
    return first, rss


def write_fixture(name: str = "small") -> Path:
    """A checkpoint from the shared fixture cache (scripts/fixtures.py), built once."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import fixtures

    return fixtures.ensure(name)


def synchronized(run, device: str) -> float:
    """Seconds of run(), the GPU's queue drained before and after (on the CPU, just the time)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def device_rows(weights: Path, device: str, repeats: int, new_tokens: int = 256, batches: tuple[int, ...] = (1, 64),
                prefill: int = 1024, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[dict]:
    """The engine on `device` (the torch runner) against transformers' generate on the same device, in the same
    dtype, TF32 off: decode rows (a 16-token prompt, greedy, (N - 1) / (t(N) - t(1)) for each of `batches`) and the
    first token of a `prefill`-token prompt. Alternating, after a warm-up each, medians (measure_row)."""
    from gpt2_engine import GPT2
    from transformers import GPT2LMHeadModel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    rows: list[dict] = []
    for dtype in dtypes:  # one pair of models at a time on the device
        rows += dtype_rows(GPT2.from_pretrained(weights, device=device, dtype=dtype),
                           GPT2LMHeadModel.from_pretrained(weights, dtype=getattr(torch, dtype)).to(device).eval(),
                           dtype, device, repeats, new_tokens, batches, prefill)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def dtype_rows(engine, hf, dtype: str, device: str, repeats: int, new_tokens: int, batches: tuple[int, ...],
               prefill: int) -> list[dict]:
    """device_rows' rows of one dtype."""
    prompt = engine.tokenizer.encode(PROMPT_16)
    rows = []

    def ours(ids: torch.Tensor, n: int) -> float:
        run = engine.generation(ids.tolist(), max_new_tokens=n, temperature=0, ignore_eos=True)
        return synchronized(run.run, device)

    def theirs(ids: torch.Tensor, n: int) -> float:
        return synchronized(lambda: reference_generate(hf, ids.to(device), n), device)

    def add(row: str, batch: int, tokens: int, eng: float, ref: float) -> None:
        rows.append({"row": row, "batch": batch, "dtype": dtype, "engine": tokens / eng, "transformers": tokens / ref,
                     "ratio": ref / eng})
        print(f"  {row} {dtype}: engine {tokens / eng:.0f}, transformers {tokens / ref:.0f} ({ref / eng:.2f}x)",
              file=sys.stderr, flush=True)

    for batch in batches:
        ids = torch.tensor([prompt] * batch)
        eng, ref = measure_row({dtype: lambda ids=ids: ours(ids, new_tokens) - ours(ids, 1)},
                               lambda ids=ids: theirs(ids, new_tokens) - theirs(ids, 1), repeats)
        add(f"decode batch {batch}, {new_tokens} new (tok/s)", batch, batch * (new_tokens - 1), eng[dtype], ref)
    ids = torch.randint(0, engine.config.vocab_size, (1, prefill), generator=torch.Generator().manual_seed(0))
    eng, ref = measure_row({dtype: lambda: ours(ids, 1)}, lambda: theirs(ids, 1), repeats)
    add(f"prefill {prefill} tokens (tok/s)", 1, prefill, eng[dtype], ref)
    return rows


def device_main(args: argparse.Namespace, weights: Path) -> int:
    """`--device cuda`: device_rows as a table and JSON."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"bench: --device {args.device}: torch {torch.__version__} sees no CUDA GPU")
    name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "CPU"
    machine = f"{name}, torch {torch.__version__}, TF32 off"
    rows = device_rows(weights, args.device, args.repeats, args.new_tokens)
    print(f"\nengine (torch runner, --device {args.device}) vs transformers 5 on the same device and dtype, {machine}")
    print(f"| {'metric':<36} | {'dtype':<8} | {'transformers':>12} | {'engine':>10} | {'ratio':>6} |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']:<36} | {r['dtype']:<8} | {r['transformers']:>12,.0f} | {r['engine']:>10,.0f} | "
              f"{r['ratio']:>5.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "device": args.device, "weights": str(weights),
                                    "repeats": args.repeats, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, help="checkpoint directory (default: the full-size fixture, written once)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for both sides (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats per row; medians are reported (default 3)")
    p.add_argument("--new-tokens", type=int, default=256, help="decode length (default 256)")
    p.add_argument("--variants", default="fp32,bf16,int8,int4", help="engine variants (default fp32,bf16,int8,int4)")
    p.add_argument("--prefill", default="128,512,1024", help="prefill lengths (default 128,512,1024)")
    p.add_argument("--score-tokens", type=int, default=50000,
                   help="tokens for the scoring row: one run each, alternating (default 50000; 0 skips it)")
    p.add_argument("--no-structured", dest="structured", action="store_false",
                   help="leave out the structured-output rows (a JSON schema against free decoding)")
    p.add_argument("--no-steering", dest="steering", action="store_false",
                   help="leave out the steering rows (decode with one steering vector against plain decode)")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "bench.json", help="where to write the JSON")
    p.add_argument("--device", default="cpu",
                   help="cuda: the engine's torch runner on the GPU against transformers there (decode batch 1 and "
                        "64 at --new-tokens, prefill 1,024; float32 and bfloat16), instead of the CPU rows")
    p.add_argument("--child", choices=["engine", "reference"], help=argparse.SUPPRESS)
    return p.parse_args()


class Rows:
    """The table's rows, each printed on stderr as it is measured: the reference's figure, each variant's and its
    ratio to the reference."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, metric: str, better: str, ref: float, results: dict[str, float]) -> None:
        row = {"metric": metric, "better": better, "transformers": ref}
        for v, val in results.items():
            row[v] = val
            row[f"{v}_ratio"] = val / ref
        self.rows.append(row)
        print(f"  {metric}: transformers {ref:.4g}, " + ", ".join(f"{v} {val:.4g} ({val / ref:.2f}x)" for v, val in results.items()),
              file=sys.stderr, flush=True)


def prefill_rows(rows: Rows, engines: dict, hf, lengths: list[int], repeats: int) -> None:
    """Prefill tokens/s at each length: random ids in, the first token out."""
    g = torch.Generator().manual_seed(0)
    for T in lengths:
        ids = torch.randint(0, 50257, (1, T), generator=g)
        runs = {v: (lambda m=m, ids=ids: engine_generate(m, ids, 1)) for v, m in engines.items()}
        eng, ref = measure_row(runs, lambda ids=ids: reference_generate(hf, ids, 1), repeats)
        rows.add(f"prefill {T} tokens (tok/s)", "higher", T / ref, {v: T / t for v, t in eng.items()})


def decode_rows(rows: Rows, engines: dict, hf, prompt: list[int], n: int, repeats: int) -> None:
    """Decode tokens/s at batch 1 and 8: (n - 1) new tokens over t(n) - t(1), prefill subtracted."""
    for batch in (1, 8):
        ids = torch.tensor([prompt] * batch)
        runs = {v: (lambda m=m, ids=ids: engine_generate(m, ids, n) - engine_generate(m, ids, 1))
                for v, m in engines.items()}
        eng, ref = measure_row(runs, lambda ids=ids: reference_generate(hf, ids, n) - reference_generate(hf, ids, 1),
                               repeats)
        tokens = batch * (n - 1)
        rows.add(f"decode batch {batch}, {n} new (tok/s)", "higher", tokens / ref, {v: tokens / t for v, t in eng.items()})


def score_row(rows: Rows, engines: dict, hf, tokens: int) -> None:
    """Scoring tokens/s of gpt2 score's core against transformers' sliding-window loop, on the same windows."""
    first = next(iter(engines.values()))
    ids = bench_text(tokens, first.tokenizer)
    context = first.config.n_positions
    runs = {v: (lambda m=m: engine_score(m, ids, context, context // 2)) for v, m in engines.items()}
    # both sides are warm from the rows above; one long run each, alternating
    eng, ref = measure_row(runs, lambda: reference_score(hf, ids, context, context // 2), 1, warmup=False)
    rows.add(f"score {len(ids)} tokens, stride {context // 2} (tok/s)", "higher", len(ids) / ref,
             {v: len(ids) / t for v, t in eng.items()})


def process_rows(rows: Rows, weights: Path, variants: list[str], threads: int, repeats: int) -> None:
    """Time from process start to the first token and the peak RSS of a generate run, fresh processes alternating."""
    starts: dict[str, list[float]] = {v: [] for v in variants}
    rss: dict[str, list[float]] = {v: [] for v in variants}
    ref_start, ref_rss = [], []
    for _ in range(repeats):
        for v in variants:
            s, r = startup_and_rss("engine", weights, v, threads)
            starts[v].append(s), rss[v].append(r)
        s, r = startup_and_rss("reference", weights, "fp32", threads)
        ref_start.append(s), ref_rss.append(r)
    rows.add("process start to first token (s)", "lower", statistics.median(ref_start),
             {v: statistics.median(x) for v, x in starts.items()})
    rows.add("peak RSS of a generate run (MiB)", "lower", statistics.median(ref_rss),
             {v: statistics.median(x) for v, x in rss.items()})


def print_extra(variant: str, structured: list[dict], steered: list[dict]) -> None:
    """The structured-output and steering tables, where they ran."""
    if structured:
        print(f"\nstructured output ({variant}, greedy, a JSON schema against free text; llguidance's mask per "
              "token):")
        print(f"{'batch':>5} {'free tok/s':>11} {'schema tok/s':>13} {'ratio':>6}")
        for r in structured:
            print(f"{r['batch']:>5} {r['free_tok_s']:>11.1f} {r['json_schema_tok_s']:>13.1f} {r['ratio']:>5.2f}x")
    if steered:
        print(f"\nsteering ({variant}, batch 1, greedy, one vector of coefficient 4 against plain decode):")
        print(f"{'hook':>26} {'tok/s':>8} {'ratio':>7}")
        for r in steered:
            print(f"{r['steering']:>26} {r['tok_s']:>8.1f} {r['ratio']:>6.3f}x")


def main() -> int:
    args = parse_args()
    weights = args.weights or write_fixture()
    if args.child:
        child(args.child, weights, args.variants, 32)
        return 0
    if args.device != "cpu":
        return device_main(args, weights)

    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    hf = load_reference(weights)
    rows = Rows()
    engines = {v: load_engine(weights, v) for v in variants}
    first = engines[variants[0]]
    prefill_rows(rows, engines, hf, [int(t) for t in args.prefill.split(",")], args.repeats)
    prompt = first.tokenizer.encode(PROMPT_16)
    decode_rows(rows, engines, hf, prompt, args.new_tokens, args.repeats)
    structured = structured_rows(first, prompt, args.new_tokens, args.repeats) if args.structured else []
    steered = steering_rows(first, prompt, args.new_tokens, max(args.repeats, 5)) if args.steering else []
    if args.score_tokens:
        score_row(rows, engines, hf, args.score_tokens)
    del engines, first, hf
    process_rows(rows, weights, variants, args.threads, args.repeats)

    from gpt2_engine.core.kernels import cpu

    machine = f"{cpu().summary()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads"
    print_table(rows.rows, variants, machine)
    print_extra(variants[0], structured, steered)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "cpu": dataclasses.asdict(cpu()), "weights": str(weights),
                                    "repeats": args.repeats, "rows": rows.rows, "structured": structured,
                                    "steering": steered}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


def print_table(rows: list[dict], variants: list[str], machine: str) -> None:
    print(f"\nengine vs transformers 5 (fp32, SDPA) on {machine}; ratio = engine / transformers")
    head = f"| {'metric':<38} | {'transformers':>12} |" + "".join(f" {'engine ' + v:>12} | {'ratio':>6} |" for v in variants)
    print(head)
    print("|" + "---|" * (2 + 2 * len(variants)))
    for r in rows:
        line = f"| {r['metric'] + (' ↑' if r['better'] == 'higher' else ' ↓'):<38} | {r['transformers']:>12.4g} |"
        line += "".join(f" {r[v]:>12.4g} | {r[v + '_ratio']:>5.2f}x |" for v in variants)
        print(line)


if __name__ == "__main__":
    sys.exit(main())

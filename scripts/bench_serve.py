#!/usr/bin/env python3
"""Benchmark `gpt2 serve` under concurrent streaming clients (`make bench-serve`).

    python scripts/bench_serve.py [--weights DIR] [--clients 1,4,8,16] [--max-tokens 64] [--requests 8]
    python scripts/bench_serve.py --baseline /tmp/base --rounds 3    # against another checkout, alternating
    python scripts/bench_serve.py --lora 4 --clients 8 --rounds 3     # multi-adapter serving (make bench-serve ARGS=--lora)
    python scripts/bench_serve.py --speculate int4 --weights trained --clients 1,8 --rounds 3   # speculative decoding

Starts the real server on 127.0.0.1 (default: the full-size fixture, 8 slots), then for each client count starts
that many clients together (each built before the clock starts), each sending --requests streaming completions one
after another (fixed prompts, greedy, ignore_eos, so every request generates exactly --max-tokens tokens). Reports
aggregate generated tokens/s, time to first token p50/p99 and inter-token latency p50/p99, and the ratios the
targets are stated in.

--lora N: N random rank-8 adapters (all four projections) written to the cache, one server with all of them
(--lora taskK=DIR) and one with none, alternating: the clients spread over the N adapters on the first, all on the
base on the second; then each adapter's outputs are checked against a server with that adapter alone.

--speculate DRAFTER: a server with `--speculate DRAFTER` against one without, alternating; the same clients on both,
and their texts compared (greedy: they must be equal). --weights trained: the trained test checkpoint.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "In the beginning", "The weather today",
           "Dear friend,", "import numpy as np", "Chapter 1."]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def one_client(url: str, index: int, requests: int, max_tokens: int, ready: threading.Barrier | None = None,
               model: str = "gpt2", texts: list[str] | None = None,
               close: bool = False) -> tuple[list[float], list[float], int]:
    """(times to first token, inter-token gaps, tokens) of one client's requests, in seconds. With `ready`, the
    client is built before the clock starts and all clients start together: building an httpx client takes
    milliseconds of CPU, and eight of them built on the clock spread the first requests over ~60 ms and charged
    the first ones' time to first token with the others' set-up. `texts`: each request's text is appended. `close`:
    a connection per request (llama-server drops a kept-alive connection between requests)."""
    ttft, gaps, tokens = [], [], 0
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=300) as client:
        if ready is not None:
            ready.wait(timeout=60)
        for r in range(requests):
            t0 = last = time.perf_counter()
            first = True
            text = ""
            with client.stream("POST", f"{url}/v1/completions", headers={"Connection": "close"} if close else None,
                               json={**body, "prompt": PROMPTS[(index + r) % len(PROMPTS)]}) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choices = json.loads(line[6:])["choices"]
                    if not choices:
                        continue
                    text += choices[0]["text"]
                    now = time.perf_counter()
                    (ttft.append(now - t0) if first else gaps.append(now - last))
                    first, last = False, now
                    tokens += 1
            if texts is not None:
                texts.append(text)
    return ttft, gaps, tokens


@contextlib.contextmanager
def server(tree: Path, weights: Path, parallel: int, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """`gpt2 serve` of the checkout at `tree` on a free 127.0.0.1 port, healthy and warmed up; its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-m", "gpt2_engine", "serve", "--weights", str(weights), "--port",
                             str(port), "--parallel", str(parallel), "--threads", "2", *extra], cwd=tree, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the server of {tree} exited with {proc.returncode}"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        one_client(url, 0, 1, 8)  # warm-up
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def measure(url: str, n: int, requests: int, max_tokens: int, models: list[str] | None = None,
            close: bool = False) -> dict:
    """One run of n clients together: aggregate tokens/s, TTFT and ITL percentiles. `models`: client i asks for
    models[i % len(models)] (default: the base, gpt2); `close`: one_client's."""
    ready = threading.Barrier(n + 1)
    models = models or ["gpt2"]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one_client, url, i, requests, max_tokens, ready, models[i % len(models)], None, close)
                   for i in range(n)]
        ready.wait(timeout=60)
        t0 = time.perf_counter()
        results = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    ttft = [x for r in results for x in r[0]]
    gaps = [x for r in results for x in r[1]]
    return {"clients": n, "tokens_per_s": sum(r[2] for r in results) / wall,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99)}


def median_row(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, help="checkpoint directory (default: the full-size fixture)")
    p.add_argument("--clients", default="1,4,8,16", help="concurrent client counts (default 1,4,8,16)")
    p.add_argument("--requests", type=int, default=8, help="requests per client (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--parallel", type=int, default=8, help="server slots (default 8)")
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help="another checkout of the project (e.g. `git worktree add /tmp/base main`): its server runs "
                        "alternately with this one's, and the table gives both and this / baseline")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds with --baseline; medians (default 1)")
    p.add_argument("--speculate", metavar="DRAFTER", help="a server with --speculate DRAFTER against one without")
    p.add_argument("--lora", type=int, metavar="N", nargs="?", const=4,
                   help="multi-adapter serving: the clients spread over N LoRA adapters (default 4) against all "
                        "on the base of an adapter-free server")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import fixtures
    from gpt2_engine.core.kernels import cpu

    weights = fixtures.ensure(str(args.weights)) if str(args.weights) in fixtures.RECIPES else (
        args.weights or fixtures.ensure("small"))
    counts = [int(c) for c in args.clients.split(",")]
    header = (f"gpt2 serve, {weights.name}, {args.parallel} slots, {args.max_tokens} tokens x {args.requests} "
              f"requests per client, greedy; {cpu().summary()}, 2 threads")
    if args.baseline is not None:
        return compare(args, weights, counts, header)
    if args.lora:
        return compare_lora(args, weights, counts, header)
    if args.speculate:
        return compare_speculate(args, weights, counts, header)
    rows = []
    with server(ROOT, weights, args.parallel) as url:
        for n in counts:
            rows.append(measure(url, n, args.requests, args.max_tokens))
            print(f"  {n} clients: {rows[-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    base = rows[0]
    print(f"\n{header}")
    print("| clients | aggregate tok/s | vs 1 client | TTFT p50 (ms) | TTFT p99 (ms) | p99 TTFT vs 1 | ITL p50 (ms) | ITL p99 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
              f"{r['ttft_p50'] * 1e3:.0f} | {r['ttft_p99'] * 1e3:.0f} | {r['ttft_p99'] / base['ttft_p99']:.2f}x | "
              f"{r['itl_p50'] * 1e3:.1f} | {r['itl_p99'] * 1e3:.1f} |")
    save({"weights": str(weights), "rows": rows})
    return 0


def alternate(args: argparse.Namespace, counts: list[int],
              sides: dict[str, tuple[str, list[str] | None]]) -> dict[tuple[str, int], list[dict]]:
    """Each client count on each of two sides (name -> (url, the models its clients ask for)), alternating which goes
    first, for --rounds rounds: every run, by (side, clients)."""
    first, second = sides
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for n in counts:
            for name in ([first, second] if (r + n) % 2 == 0 else [second, first]):
                url, models = sides[name]
                runs.setdefault((name, n), []).append(measure(url, n, args.requests, args.max_tokens, models))
                print(f"  round {r + 1}, {n} clients, {name}: {runs[name, n][-1]['tokens_per_s']:.1f} tok/s",
                      file=sys.stderr, flush=True)
    return runs


def compare(args: argparse.Namespace, weights: Path, counts: list[int], header: str) -> int:
    """This checkout against --baseline: both servers up, each client count measured on one then the other,
    alternating which goes first, for --rounds rounds; medians."""
    trees = {"baseline": args.baseline.resolve(), "this": ROOT}
    with server(trees["baseline"], weights, args.parallel) as base_url, server(ROOT, weights, args.parallel) as url:
        runs = alternate(args, counts, {"baseline": (base_url, None), "this": (url, None)})
    print(f"\n{header}; this checkout against {trees['baseline']}, {args.rounds} alternating round(s), medians")
    print("| clients | tok/s baseline | tok/s this | ratio | TTFT p99 baseline (ms) | TTFT p99 this (ms) | ratio | "
          "ITL p50 baseline (ms) | ITL p50 this (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = []
    for n in counts:
        b, t = median_row(runs["baseline", n]), median_row(runs["this", n])
        table.append({"clients": n, "baseline": b, "this": t})
        print(f"| {n} | {b['tokens_per_s']:.1f} | {t['tokens_per_s']:.1f} | {t['tokens_per_s'] / b['tokens_per_s']:.2f}x | "
              f"{b['ttft_p99'] * 1e3:.0f} | {t['ttft_p99'] * 1e3:.0f} | {t['ttft_p99'] / b['ttft_p99']:.2f}x | "
              f"{b['itl_p50'] * 1e3:.1f} | {t['itl_p50'] * 1e3:.1f} |")
    save({"weights": str(weights), "baseline": str(trees["baseline"]), "rounds": args.rounds, "rows": table})
    return 0


def write_adapters(weights: Path, n: int) -> list[Path]:
    """n random rank-8 adapters on all four projections (B nonzero, so that each changes the text), in the cache."""
    import torch

    from gpt2_engine.core.config import GPT2Config
    from gpt2_engine.core.lora import LoraAdapter, LoraSettings, new_adapter
    from gpt2_engine.formats.peft import save_adapter

    config = GPT2Config.from_json(weights / "config.json")
    paths = []
    for k in range(n):
        g = torch.Generator().manual_seed(k)
        ad = new_adapter(config, LoraSettings(r=8, alpha=16.0), g)
        tensors = {name: t if name.endswith("lora_A") else 0.02 * torch.randn(t.shape, generator=g)
                   for name, t in ad.tensors.items()}
        path = ROOT / ".cache" / "bench-lora" / f"{weights.name}-task{k}"
        save_adapter(path, LoraAdapter(ad.settings, tensors))
        paths.append(path)
    return paths


def texts_of(url: str, index: int, max_tokens: int, model: str) -> list[str]:
    """The texts of client `index`'s 4 requests to `model` (greedy)."""
    texts: list[str] = []
    one_client(url, index, 4, max_tokens, None, model, texts)
    return texts


def compare_lora(args: argparse.Namespace, weights: Path, counts: list[int], header: str) -> int:
    """Clients over N adapters on one server against clients on the base of an adapter-free server, alternating;
    then every adapter's texts against a server holding that adapter alone."""
    paths = write_adapters(weights, args.lora)
    names = [f"task{k}" for k in range(args.lora)]
    flags = tuple(x for name, path in zip(names, paths) for x in ("--lora", f"{name}={path}"))
    with server(ROOT, weights, args.parallel) as base_url, server(ROOT, weights, args.parallel, flags) as url:
        runs = alternate(args, counts, {"base": (base_url, None), "adapters": (url, names)})
        # the outputs under load: every adapter's prompts at once, 2 clients each
        with concurrent.futures.ThreadPoolExecutor(2 * len(names)) as pool:
            jobs = {(name, i): pool.submit(texts_of, url, i, args.max_tokens, name) for name in names for i in range(2)}
            together = {key: job.result() for key, job in jobs.items()}
    same = 0
    for name, path in zip(names, paths):
        with server(ROOT, weights, args.parallel, ("--lora", f"{name}={path}")) as alone:
            same += sum(texts_of(alone, i, args.max_tokens, name) == together[name, i] for i in range(2))
    print(f"\n{header}; {args.lora} LoRA adapters (r=8, all projections), {args.rounds} alternating round(s), medians")
    table = side_by_side(runs, counts, ("base", "base only (adapter-free server)"),
                         ("adapters", "spread over the adapters"))
    print(f"outputs under load equal to each adapter served alone: {same} of {2 * len(names)} clients "
          f"({8 * len(names)} requests)")
    save({"weights": str(weights), "lora": args.lora, "rounds": args.rounds, "rows": table,
          "same_as_alone": f"{same}/{2 * len(names)}"}, "bench_serve_lora.json")
    return 0 if same == 2 * len(names) else 1


def side_by_side(runs: dict[tuple[str, int], list[dict]], counts: list[int], first: tuple[str, str],
                 second: tuple[str, str]) -> list[dict]:
    """Print the table of two sides' medians ((key, column title) each) by client count, second / first; its rows."""
    (a_key, a_title), (b_key, b_title) = first, second
    print(f"| clients | {a_title} tok/s | {b_title} tok/s | ratio | ITL p50 {a_key} (ms) | ITL p50 {b_key} (ms) |")
    print("|---|---|---|---|---|---|")
    table = [{"clients": n, a_key: median_row(runs[a_key, n]), b_key: median_row(runs[b_key, n])} for n in counts]
    for row in table:
        a, b = row[a_key], row[b_key]
        print(f"| {row['clients']} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
              f"{b['tokens_per_s'] / a['tokens_per_s']:.2f}x | {a['itl_p50'] * 1e3:.1f} | {b['itl_p50'] * 1e3:.1f} |")
    return table


def compare_speculate(args: argparse.Namespace, weights: Path, counts: list[int], header: str) -> int:
    """A server with --speculate against one without, alternating; then each client's texts on both."""
    from gpt2_engine.serve.metrics import parse

    flags = ("--speculate", args.speculate)
    with server(ROOT, weights, args.parallel) as plain_url, server(ROOT, weights, args.parallel, flags) as url:
        runs = alternate(args, counts, {"plain": (plain_url, None), "speculate": (url, None)})
        same = sum(texts_of(url, i, args.max_tokens, "gpt2") == texts_of(plain_url, i, args.max_tokens, "gpt2")
                   for i in range(len(PROMPTS)))
        metrics = parse(httpx.get(f"{url}/metrics").text)
    accepted, drafted = (metrics[f"gpt2_speculative_{n}_tokens_total"] for n in ("accepted", "draft"))
    print(f"\n{header}; --speculate {args.speculate} against none, {args.rounds} alternating round(s), medians")
    table = side_by_side(runs, counts, ("plain", "plain"), ("speculate", "--speculate"))
    rate = accepted / drafted if drafted else float("nan")
    print(f"acceptance over the run: {accepted:.0f} of {drafted:.0f} drafted ({rate:.0%}); greedy texts equal to the "
          f"plain server's: {same} of {len(PROMPTS)} prompts")
    save({"weights": str(weights), "speculate": args.speculate, "rounds": args.rounds, "rows": table,
          "acceptance": rate, "same_as_plain": f"{same}/{len(PROMPTS)}"}, "bench_serve_speculate.json")
    return 0 if same == len(PROMPTS) else 1


def save(result: dict, name: str = "bench_serve.json") -> None:
    from gpt2_engine.core.kernels import cpu

    out = ROOT / "bench-results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu().summary(), **result}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())

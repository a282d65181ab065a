#!/usr/bin/env python3
"""Benchmark evaluation with lm-eval's requests (`make bench-eval`): the prefix cache in `gpt2 serve`, and `gpt2
eval` against `lm_eval --model hf`.

    python scripts/bench_eval.py [--weights DIR] [--docs 100] [--fewshot-docs 100] [--skip-hf]

Two local tasks (scripts/eval_tasks.py) on the full-size fixture: `local_long_choice`, 4 endings after ~400-token
contexts, and `local_fewshot`, a multiple-choice question after the same 5 worked examples. Results go to
bench-results/bench_eval.json.

1. Server: every loglikelihood request of each task, as lm-eval's local-completions sends them (token ids, echo,
   logprobs 1, max_tokens 1, one at a time), against `gpt2 serve` and `gpt2 serve --no-prefix-cache`, rounds
   alternating; requests/s, and each request's loglikelihood compared between the two servers.
2. `gpt2 eval` (lm_eval.simple_evaluate with the engine) against `lm_eval --model hf` (batch size 1, lm-eval's
   default) on the same task files: wall time and metrics.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_tasks  # noqa: E402
import fixtures  # noqa: E402
from bench_serve import ROOT, save, server  # noqa: E402


def requests_of(task_yaml: Path, tokenizer) -> list[tuple[list[int], int]]:
    """The task's loglikelihood requests as (prompt ids, context length): lm-eval's own instances, tokenized as its
    TemplateLM does (the trailing-space rule) with this tokenizer."""
    from lm_eval.tasks import TaskManager

    task = next(iter(TaskManager().load([str(task_yaml)])["tasks"].values()))
    task.build_all_requests(limit=None, rank=0, world_size=1)
    out = []
    for inst in task.instances:
        context, continuation = inst.args
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
        out.append((whole, len(ctx)))
    return out


def replay(url: str, requests: list[tuple[list[int], int]]) -> tuple[float, list[float], int]:
    """(seconds, each request's continuation loglikelihood, cached prompt tokens), one request at a time."""
    scores, cached = [], 0
    with httpx.Client(timeout=600) as client:
        t0 = time.perf_counter()
        for ids, ctxlen in requests:
            r = client.post(f"{url}/v1/completions", json={"model": "gpt2", "prompt": ids, "max_tokens": 1,
                                                           "echo": True, "logprobs": 1, "temperature": 0})
            r.raise_for_status()
            body = r.json()
            scores.append(sum(body["choices"][0]["logprobs"]["token_logprobs"][ctxlen:-1]))
            cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
        return time.perf_counter() - t0, scores, cached


def bench_server(weights: Path, tasks: dict[str, Path], rounds: int) -> dict:
    from gpt2_engine.core.tokenizer import load_tokenizer

    tok = load_tokenizer(weights)
    out = {}
    for name, path in tasks.items():
        reqs = requests_of(path, tok)
        times: dict[str, list[float]] = {"cache": [], "none": []}
        scores: dict[str, list[float]] = {}
        cached = 0
        for r in range(rounds):
            for side in (("cache", "none") if r % 2 == 0 else ("none", "cache")):
                extra = () if side == "cache" else ("--no-prefix-cache",)
                with server(ROOT, weights, 8, extra) as url:
                    seconds, scores[side], hit = replay(url, reqs)
                times[side].append(seconds)
                cached = hit if side == "cache" else cached
                print(f"  {name} round {r + 1} {side:5s}: {len(reqs) / seconds:6.2f} requests/s", flush=True)
        a, b = scores["cache"], scores["none"]
        rel = max(abs(x - y) / max(abs(y), 1e-9) for x, y in zip(a, b))
        prompt_tokens = sum(len(ids) for ids, _ in reqs)
        out[name] = {"requests": len(reqs), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                     "cache_rps": len(reqs) / statistics.median(times["cache"]),
                     "none_rps": len(reqs) / statistics.median(times["none"]), "max_rel_diff": rel}
        out[name]["ratio"] = out[name]["cache_rps"] / out[name]["none_rps"]
    return out


def bench_eval(weights: Path, tasks: dict[str, Path], skip_hf: bool) -> dict:
    import lm_eval

    from gpt2_engine.api import GPT2
    from gpt2_engine.harness import EngineLM

    paths = [str(p) for p in tasks.values()]

    def metrics(results: dict) -> dict[str, float]:
        return {f"{t}/{k}": float(v) for t, vals in results["results"].items() for k, v in vals.items()
                if "," in k and "stderr" not in k}

    t0 = time.perf_counter()
    ours = lm_eval.simple_evaluate(model=EngineLM(GPT2.from_pretrained(weights)), tasks=paths)
    out = {"engine_seconds": time.perf_counter() - t0, "engine_metrics": metrics(ours)}
    print(f"  gpt2 eval: {out['engine_seconds']:.1f} s {out['engine_metrics']}", flush=True)
    if not skip_hf:
        t0 = time.perf_counter()
        ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={weights},dtype=float32", tasks=paths,
                                      device="cpu", batch_size=1)
        out["hf_seconds"], out["hf_metrics"] = time.perf_counter() - t0, metrics(ref)
        out["ratio"] = out["hf_seconds"] / out["engine_seconds"]
        print(f"  lm_eval --model hf: {out['hf_seconds']:.1f} s {out['hf_metrics']}", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=Path, help="checkpoint (default: the full-size fixture)")
    p.add_argument("--docs", type=int, default=100, help="documents of the 400-token multiple-choice task (default 100)")
    p.add_argument("--fewshot-docs", type=int, default=100, help="documents of the 5-shot task (default 100)")
    p.add_argument("--rounds", type=int, default=2, help="server rounds per side, alternating (default 2)")
    p.add_argument("--skip-hf", action="store_true", help="no lm_eval --model hf run")
    p.add_argument("--skip-server", action="store_true", help="no server rounds")
    args = p.parse_args()
    import torch

    from gpt2_engine.core.kernels import cpu

    torch.set_num_threads(2)
    weights = args.weights or fixtures.ensure("small")
    d = ROOT / ".cache" / "bench-eval"
    tasks = {"local_long_choice": eval_tasks.long_choice(d, docs=args.docs),
             "local_fewshot": eval_tasks.fewshot(d, docs=args.fewshot_docs, shots=5, context_words=40)}
    print(f"bench-eval: {weights.name}; {cpu().summary()}, 2 threads", flush=True)
    result: dict = {"weights": str(weights)}
    if not args.skip_server:
        result["server"] = bench_server(weights, tasks, args.rounds)
    result["eval"] = bench_eval(weights, tasks, args.skip_hf)
    print(f"\n{cpu().summary()}; {weights.name}, 2 threads")
    print("| task | requests | prompt tokens | cached | requests/s, prefix cache | without | ratio | max rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in result.get("server", {}).items():
        print(f"| {name} | {row['requests']} | {row['prompt_tokens']:,} | {row['cached_tokens']:,} | "
              f"{row['cache_rps']:.2f} | {row['none_rps']:.2f} | **{row['ratio']:.2f}x** | {row['max_rel_diff']:.1e} |")
    e = result["eval"]
    if "hf_seconds" in e:
        same = all(abs(e["engine_metrics"][k] - v) <= 1e-4 * abs(v) for k, v in e["hf_metrics"].items())
        print(f"\ngpt2 eval {e['engine_seconds']:.1f} s, lm_eval --model hf {e['hf_seconds']:.1f} s: "
              f"**{e['ratio']:.2f}x**; metrics {'equal within 1e-4' if same else 'DIFFER'}: {e['engine_metrics']}")
    save(result, "bench_eval.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

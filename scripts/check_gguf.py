"""`gpt2 convert --to gguf`, checked by llama.cpp itself (`make check-gguf`; builds llama.cpp once, as
`make bench-llamacpp` does).

For the full-size fixture and the trained fixture: the engine writes f32, f16 and q8_0 GGUFs (no llama.cpp
converter involved), llama-server loads each, and
- f32: llama.cpp's greedy ids equal the engine's for 64 new tokens on each of 3 prompts;
- f16 and q8_0: at every position of the engine's float32 greedy continuations, llama.cpp's next token (fed the same
  prefix) agrees with the engine's float32 choice; the agreement is reported (>= 99% required on the trained
  fixture, whose distributions are peaked; the random full-size fixture's are near-uniform, so its figure is shown
  only).
Exit status 1 when a requirement does not hold.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import bench_llamacpp  # noqa: E402
import fixtures  # noqa: E402

from gpt2_engine import GPT2  # noqa: E402
from gpt2_engine.commands.convert import convert  # noqa: E402

PROMPTS = ("The meaning of life is", "Return the number of", "If the file does not exist,")
NEW = 64
OUT = bench_llamacpp.CACHE / "check-gguf"


def llama_tokens(url: str, ids: list[int], n: int) -> list[int]:
    """llama-server's greedy continuation of token ids (nothing prepended, <|endoftext|> not stopping it)."""
    r = httpx.post(f"{url}/completion", timeout=300, json={
        "prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True, "return_tokens": True,
        "cache_prompt": True})
    r.raise_for_status()
    return r.json()["tokens"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fixtures", default="small,trained", help="fixtures to check (default small,trained)")
    args = p.parse_args()
    bin_dir, _ = bench_llamacpp.llamacpp()
    OUT.mkdir(parents=True, exist_ok=True)
    failed = False
    print(f"{'checkpoint':<10} {'gguf':<6} {'check':<44} result")
    for name in args.fixtures.split(","):
        weights = fixtures.ensure(name)
        model = GPT2.from_pretrained(weights)
        prompts = [model.tokenizer.encode(t) for t in PROMPTS]
        engine = [model.generate_ids(ids, max_new_tokens=NEW, temperature=0, ignore_eos=True) for ids in prompts]
        for qtype in ("f32", "f16", "q8_0"):
            path = OUT / f"{name}-{qtype}.gguf"
            convert(weights, path, "gguf", qtype, overwrite=True)
            with bench_llamacpp.llama_server(bin_dir, path, threads=2, parallel=1) as url:
                if qtype == "f32":
                    same = [llama_tokens(url, ids, NEW) == out for ids, out in zip(prompts, engine)]
                    ok = all(same)
                    result = f"{sum(same)}/3 prompts: the same {NEW} greedy ids"
                else:
                    agree = total = 0
                    for ids, out in zip(prompts, engine):
                        for k in range(NEW):
                            agree += llama_tokens(url, ids + out[:k], 1) == [out[k]]
                            total += 1
                    ok = name != "trained" or agree / total >= 0.99
                    result = f"{agree}/{total} = {agree / total:.1%} top-1 agreement with float32"
            failed |= not ok
            check = "greedy ids, llama.cpp vs the engine" if qtype == "f32" else "next token vs the engine's float32"
            print(f"{name:<10} {qtype:<6} {check:<44} {result}{'' if ok else '  FAILED'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

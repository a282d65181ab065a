#!/usr/bin/env python3
"""Training-step speed and memory: the engine's hand-written step against transformers + autograd + torch's AdamW.

    python scripts/bench_train.py [--shapes 4x64,4x512] [--lora-rows small:4x64,medium:4x64] [--rounds 2]
                                  [--steps 2] [--out FILE.json]

Full fine-tuning: one update (forward, backward, global-norm clipping at 1.0, AdamW) of GPT-2 small (the full-size
fixture), float32, dropout 0, on the same random batches for both sides.
LoRA: the same update of a rank-8 adapter (alpha 16) on all four projections of every block, the base frozen: the
engine on the float32 base and on the base quantized to int4 (QLoRA), against transformers + peft's LoRA layers +
autograd, all from the same initial adapter on the same batches.
Each side runs in its own process (so that its peak RSS is its own), and the processes alternate for --rounds
rounds; a process times --steps updates after one warm-up update. The tables have medians over all timed updates,
tokens/s, the ratios, and each side's peak RSS (the largest over its processes). The CPU is named in the header.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(SCRIPTS.parent))


def batches(B: int, T: int, n: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        rows = torch.randint(0, vocab, (B, T + 1), generator=g)
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def run_engine(weights: Path, B: int, T: int, steps: int) -> list[float]:
    import torch

    from gpt2_engine.core.config import GPT2Config
    from gpt2_engine.formats.hf import load_weights
    from gpt2_engine.core.weights import named_tensors
    from gpt2_engine.train.optim import AdamW, AdamWSettings, clip_factor
    from gpt2_engine.train.step import Buffers, decayed, forward_loss, trainable_copy, zero_, zeros_like

    config = GPT2Config.from_json(weights / "config.json")
    w = trainable_copy(load_weights(weights, config), config)
    grads = zeros_like(w, config)
    params, grad_named = named_tensors(w), named_tensors(grads)
    opt = AdamW(params, {n for n in params if decayed(n)}, AdamWSettings(beta2=0.999, weight_decay=0.01))
    buf = Buffers.allocate(config, B, T)
    times = []
    with torch.no_grad():
        for ids, targets in batches(B, T, steps + 1, config.vocab_size):
            t0 = time.perf_counter()
            zero_(grads)
            forward_loss(w, config, buf, ids, targets, grads=grads, grad_scale=1.0 / (B * T))
            _, factor = clip_factor(grad_named, 1.0)
            opt.step(grad_named, 1e-4, factor)
            times.append(time.perf_counter() - t0)
    return times[1:]


LORA_R, LORA_ALPHA = 8, 16.0


def run_engine_lora(weights: Path, B: int, T: int, steps: int, quantize: str | None, recompute: bool) -> list[float]:
    import torch

    from gpt2_engine.core.config import GPT2Config
    from gpt2_engine.core.lora import LoraSettings, new_adapter, trainable
    from gpt2_engine.core.quantize import quantize_weights
    from gpt2_engine.formats.hf import find_weights_file, load_weights
    from gpt2_engine.train.optim import AdamW, AdamWSettings, clip_factor
    from gpt2_engine.train.step import Buffers, adapter_gradients, forward_loss

    config = GPT2Config.from_json(weights / "config.json")
    base = load_weights(weights, config, resident=quantize is None)  # frozen: used in place from the file
    if quantize:
        base = quantize_weights(base, quantize, find_weights_file(weights))
    settings = LoraSettings(r=LORA_R, alpha=LORA_ALPHA)
    w, params = trainable(base, new_adapter(config, settings, torch.Generator().manual_seed(0)))
    grads_w, grads = adapter_gradients(w, config, settings)
    opt = AdamW(params, set(params), AdamWSettings(beta2=0.999, weight_decay=0.01))
    buf = Buffers.allocate(config, B, T, lora=settings, quantized=quantize is not None, recompute=recompute)
    times = []
    with torch.no_grad():
        for ids, targets in batches(B, T, steps + 1, config.vocab_size):
            t0 = time.perf_counter()
            for g in grads.values():
                g.zero_()
            forward_loss(w, config, buf, ids, targets, grads=grads_w, grad_scale=1.0 / (B * T))
            _, factor = clip_factor(grads, 1.0)
            opt.step(grads, 1e-4, factor)
            times.append(time.perf_counter() - t0)
    return times[1:]


def run_peft(weights: Path, B: int, T: int, steps: int) -> list[float]:
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from gpt2_engine.core.config import GPT2Config
    from gpt2_engine.formats.peft import PEFT_PREFIX
    from gpt2_engine.core.lora import LoraSettings, new_adapter

    hf_logging.set_verbosity_error()
    model = GPT2LMHeadModel.from_pretrained(weights, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    settings = LoraSettings(r=LORA_R, alpha=LORA_ALPHA)
    model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(settings.targets),
                                             fan_in_fan_out=True)).train()
    adapter = new_adapter(GPT2Config.from_json(weights / "config.json"), settings, torch.Generator().manual_seed(0))
    set_peft_model_state_dict(model, {PEFT_PREFIX + n + ".weight": t.t().contiguous() for n, t in adapter.tensors.items()})
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, weight_decay=0.01)
    V = model.config.vocab_size
    times = []
    for ids, targets in batches(B, T, steps + 1, V):
        t0 = time.perf_counter()
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


def run_transformers(weights: Path, B: int, T: int, steps: int, fused: bool) -> list[float]:
    import torch
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = GPT2LMHeadModel.from_pretrained(weights, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0).train()
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n and "wpe" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "wte" not in n and "wpe" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, fused=fused or None)
    V = model.config.vocab_size
    times = []
    for ids, targets in batches(B, T, steps + 1, V):
        t0 = time.perf_counter()
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


def child(args: argparse.Namespace) -> None:
    B, T = args.shape
    if args.side == "engine":
        times = run_engine(args.weights, B, T, args.steps)
    elif args.side.startswith("engine-"):  # engine-lora, engine-qlora-int4, each with -recompute or not
        times = run_engine_lora(args.weights, B, T, args.steps, "int4" if "int4" in args.side else None,
                                args.side.endswith("-recompute"))
    elif args.side == "peft":
        times = run_peft(args.weights, B, T, args.steps)
    else:
        times = run_transformers(args.weights, B, T, args.steps, args.fused)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB
    print(json.dumps({"times": times, "peak_rss_mb": rss}))


LORA_SIDES = ("engine-lora", "engine-qlora-int4", "peft", "engine-lora-recompute", "engine-qlora-int4-recompute")
SIDES = ["engine", "transformers", *LORA_SIDES]


def medium_checkpoint() -> Path:
    """Random weights of GPT-2 medium's shape in the official layout (make_fixture's writer), built once into the
    cache: LoRA's and QLoRA's memory at a size where the weights, not torch itself, dominate a process."""
    import tempfile

    from make_fixture import random_state_dict, write_checkpoint

    dest = SCRIPTS.parent / ".cache" / "bench-train" / "medium"
    if not (dest / "config.json").is_file():
        shape = dict(n_layer=24, n_head=16, n_embd=1024, n_positions=1024)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent))
        write_checkpoint(tmp / "out", shape, random_state_dict(**shape, seed=0))
        (tmp / "out").rename(dest)
        tmp.rmdir()
    return dest


def shape(text: str) -> tuple[int, int]:
    b, t = text.lower().split("x")
    return int(b), int(t)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4x64,4x512", help="BxT shapes, comma-separated (default 4x64,4x512)")
    parser.add_argument("--lora-rows", default="small:4x64,small:4x512,medium:4x64",
                        help="rows of the LoRA table, MODEL:BxT comma-separated ('' for none): small is the full-size "
                             "fixture, medium random weights of GPT-2 medium's shape (355M, written to the cache once) "
                             "(default small:4x64,small:4x512,medium:4x64)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--steps", type=int, default=2, help="timed updates per process (default 2)")
    parser.add_argument("--fused", action="store_true", help="transformers side: torch.optim.AdamW(fused=True)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--child", choices=SIDES, dest="side", help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=shape, help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.side:
        child(args)
        return 0

    import fixtures
    import torch

    from gpt2_engine.core.kernels import cpu

    weights = fixtures.ensure("small")
    threads = args.threads or torch.get_num_threads()
    print(f"# training step, float32, dropout 0 (full fine-tuning: GPT-2 small, 124M) | {cpu().summary()} | {threads} threads | "
          f"torch {torch.__version__} | medians of {args.rounds} x {args.steps} updates, alternating")

    def measure(sides: tuple[str, ...], B: int, T: int, checkpoint: Path = weights) -> dict[str, dict]:
        found = {side: {"times": [], "rss": 0.0} for side in sides}
        for _ in range(args.rounds):
            for side in sides:
                cmd = [sys.executable, __file__, "--child", side, "--shape", f"{B}x{T}", "--weights", str(checkpoint),
                       "--steps", str(args.steps)] + (["--fused"] if args.fused else []) + (
                       ["--threads", str(args.threads)] if args.threads else [])
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                found[side]["times"] += r["times"]
                found[side]["rss"] = max(found[side]["rss"], r["peak_rss_mb"])
        for f in found.values():
            f["median"] = statistics.median(f["times"])
        return found

    rows = []
    for text in filter(None, args.shapes.split(",")):
        B, T = shape(text)
        found = measure(("engine", "transformers"), B, T)
        e, h = found["engine"]["median"], found["transformers"]["median"]
        row = {"B": B, "T": T, "engine_s": e, "transformers_s": h, "engine_tok_s": B * T / e,
               "transformers_tok_s": B * T / h, "speedup": h / e, "engine_rss_mb": found["engine"]["rss"],
               "transformers_rss_mb": found["transformers"]["rss"],
               "rss_ratio": found["engine"]["rss"] / found["transformers"]["rss"],
               "engine_times": found["engine"]["times"], "transformers_times": found["transformers"]["times"]}
        rows.append(row)
        print(f"full B={B} T={T}: engine {row['engine_tok_s']:.0f} tok/s ({e:.2f} s/update), transformers "
              f"{row['transformers_tok_s']:.0f} tok/s ({h:.2f} s) -> {row['speedup']:.2f}x | peak RSS "
              f"{row['engine_rss_mb']:,.0f} MB vs {row['transformers_rss_mb']:,.0f} MB -> {row['rss_ratio']:.2f}x",
              flush=True)
    lora_rows = []
    for model_name, text in (row.split(":") for row in filter(None, args.lora_rows.split(","))):
        B, T = shape(text)
        found = measure(LORA_SIDES, B, T, weights if model_name == "small" else medium_checkpoint())
        tok = {side: B * T / found[side]["median"] for side in LORA_SIDES}
        rss = {side: found[side]["rss"] for side in LORA_SIDES}
        row = {"model": model_name, "B": B, "T": T, "tok_s": tok, "peak_rss_mb": rss,
               "lora_vs_peft": tok["engine-lora"] / tok["peft"],
               "qlora_int4_vs_peft": tok["engine-qlora-int4"] / tok["peft"],
               "qlora_speed_vs_lora": tok["engine-qlora-int4"] / tok["engine-lora"],
               "qlora_rss_vs_lora": rss["engine-qlora-int4"] / rss["engine-lora"],
               "recompute_qlora_speed_vs_lora": tok["engine-qlora-int4-recompute"] / tok["engine-lora-recompute"],
               "recompute_qlora_rss_vs_lora": rss["engine-qlora-int4-recompute"] / rss["engine-lora-recompute"],
               "times": {side: found[side]["times"] for side in LORA_SIDES}}
        lora_rows.append(row)
        print(f"LoRA r={LORA_R}, GPT-2 {model_name}, B={B} T={T}: tok/s engine {tok['engine-lora']:.0f}, QLoRA int4 "
              f"{tok['engine-qlora-int4']:.0f}, transformers+peft {tok['peft']:.0f} -> engine {row['lora_vs_peft']:.2f}x "
              f"peft, QLoRA {row['qlora_int4_vs_peft']:.2f}x peft and {row['qlora_speed_vs_lora']:.2f}x LoRA | peak RSS "
              f"{rss['engine-lora']:,.0f} / {rss['engine-qlora-int4']:,.0f} / {rss['peft']:,.0f} MB -> QLoRA "
              f"{row['qlora_rss_vs_lora']:.2f}x LoRA", flush=True)
        print(f"  with --recompute: tok/s LoRA {tok['engine-lora-recompute']:.0f}, QLoRA int4 "
              f"{tok['engine-qlora-int4-recompute']:.0f} -> {row['recompute_qlora_speed_vs_lora']:.2f}x | peak RSS "
              f"{rss['engine-lora-recompute']:,.0f} / {rss['engine-qlora-int4-recompute']:,.0f} MB -> QLoRA "
              f"{row['recompute_qlora_rss_vs_lora']:.2f}x LoRA", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu().summary(), "threads": threads, "rows": rows, "lora_rows": lora_rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
